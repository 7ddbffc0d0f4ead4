"""The reference an evaluation compares against: the same model, dense attention, float16 KV cache."""

from __future__ import annotations

from pathlib import Path

from .. import __version__
from ..errors import EllmError
from ..fsutil import sha256_file
from ..models import resolve_model
from ..runtime.artifact import Artifact


def is_reference(art: Artifact) -> bool:
    from ..kv.plan import KVType

    plan = art.kv_plan
    precision = art.manifest.get("precision", {})
    lowered = precision.get("weights", {}) or precision.get("head_split")  # stored below their source type
    return set(plan.k) == set(plan.v) == {KVType.F16} and not lowered


def activations_of(art: Artifact) -> str:
    """The --activations value that compiles the artifact's target as it was compiled: auto where that is what
    auto chooses for the target (matmuls and attention's own rounding), else the steps' and chunks' one."""
    from ..compiler.pass_context import auto_activations
    from ..schedules.attention import default_int_bits
    from ..targets import resolve_target

    a = art.target["activations"]
    preset = resolve_target(art.target["preset"])
    if (a["steps"], a["chunks"]) == auto_activations(preset) and a.get("attention_bits") == str(default_int_bits(preset)):
        return "auto"
    assert a["steps"] == a["chunks"], a
    return a["steps"]


def reference_artifact(path: Path, model: str | None, log=print) -> Path:
    """`path` itself if it is already the reference configuration; else the GGUF it was compiled from,
    compiled (once, cached) with a float16 KV cache for the same target and activation precision."""
    from ..compiler.build import CompileOptions, compile_model
    from ..demo import cache_root

    art = Artifact.open(path)
    if is_reference(art):
        return path
    gguf = resolve_model(model)
    digest = sha256_file(gguf)
    if digest != art.manifest["source"]["sha256"]:
        raise EllmError(f"{gguf} is not the GGUF {path} was compiled from (pass it with --model)")
    preset = art.target["preset"]
    activations = activations_of(art)
    out = cache_root() / f"reference-{digest[:12]}-{preset}-{activations}-f16-ellm{__version__}"
    try:
        if is_reference(Artifact.open(out)):
            return out
    except EllmError:
        pass
    log(f"compiling the dense float16-KV reference into {out} (once) ...")
    options = CompileOptions(target=preset, cache_type_k="f16", cache_type_v="f16", activations=activations)
    compile_model(gguf, out, options, force=True, log=log)
    return out
