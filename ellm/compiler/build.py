"""`ellm compile`: GGUF -> graph -> passes -> TVM kernels + Relax VM -> artifact directory (atomically)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .. import __version__
from ..config import ModelConfig
from ..errors import EllmError
from ..fsutil import atomic_directory
from ..models import resolve_model
from ..runtime.artifact import KERNELS, TOKENIZER, WEIGHTS
from ..runtime.tokenizer import Tokenizer
from ..targets import TargetPreset, compute_features, resolve_target
from .artifact import write_manifest, write_weights
from .gguf_file import GGUFFile
from .graph import Graph
from ..kv.plan import KVPlan, parse_kv_type
from .import_llama import import_llama
from .inspect import decode_weight_bytes
from .lower import ENTRIES, lower
from .pack_weights import pack_params
from .pass_context import ACTIVATIONS, KVOptions, PassContext
from .pipeline import REQUIRED, enabled_passes, pass_names, run_pipeline


@dataclass(frozen=True)
class CompileOptions:
    target: str = "auto"  # a preset name or "auto"
    cache_type_k: str = "auto"  # f32 | f16 | q8_0 | q4_0 | auto (kv/plan.py KV_TYPE_CHOICES; auto: KVPlan.auto)
    cache_type_v: str = "auto"
    kv_block: int = 64  # tokens per KV block
    kv_recent: int = 2  # blocks a query reads at float16 (the current one included) before the store's precision
    disable_passes: tuple[str, ...] = ()
    enable_passes: tuple[str, ...] = ()  # opt-in passes (pipeline.OPT_IN)
    tuning_db: Path | None = None
    max_chunk: int = 256  # most tokens per prefill step; buffers are planned for this size
    activations: str = "auto"  # "int16"/"int8" (integer matmuls), "f32" (float path), "auto": int16 (AVX2 and later)
    prefetch: bool = True  # software prefetch in the weight streams (schedules/inject_prefetch.py)

    def __post_init__(self) -> None:
        if self.activations not in ("auto", *ACTIVATIONS):
            raise EllmError(f"activations must be auto, {', '.join(ACTIVATIONS)}; got {self.activations!r}")
        if not 1 <= self.max_chunk <= 65536:
            raise EllmError(f"max_chunk must be between 1 and 65536, got {self.max_chunk}")
        for t in (self.cache_type_k, self.cache_type_v):
            parse_kv_type(t)
        if REQUIRED & set(self.disable_passes):
            raise EllmError(f"pass(es) {sorted(REQUIRED & set(self.disable_passes))} cannot be disabled")
        unknown = (set(self.disable_passes) | set(self.enable_passes)) - set(pass_names())
        if unknown:
            raise EllmError(f"unknown pass(es) {sorted(unknown)}; passes are: {', '.join(pass_names())}")


@dataclass
class CompileReport:
    path: Path
    seconds: float
    kernels: int
    artifact_bytes: int
    timings: dict[str, float] = field(default_factory=dict)


def pass_context(options: CompileOptions, preset: TargetPreset) -> PassContext:
    activations = options.activations
    if activations == "auto":
        activations = "int16" if preset.isa is not None else "f32"
    elif activations != "f32" and preset.isa is None:
        raise EllmError(f"{activations} activations need integer dot products (AVX2 or later), which target {preset.name} lacks")
    kv = KVOptions(parse_kv_type(options.cache_type_k), parse_kv_type(options.cache_type_v), options.kv_block,
                   options.kv_recent, options.max_chunk)
    return PassContext(preset, activations, kv)


def build_graph(gf: GGUFFile, cfg: ModelConfig, options: CompileOptions, preset: TargetPreset) -> tuple[Graph, Graph]:
    """(imported graph, optimised graph)."""
    g0 = import_llama(gf, cfg)
    return g0, run_pipeline(g0, pass_context(options, preset), disable=options.disable_passes, enable=options.enable_passes)


def compile_model(
    model: str | Path | None,
    out_dir: str | Path,
    options: CompileOptions = CompileOptions(),
    force: bool = False,
    log: Callable[[str], None] = lambda s: None,
) -> CompileReport:
    import tvm
    from tvm import relax

    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    out_dir = Path(out_dir)
    if out_dir.exists() and not force:
        raise EllmError(f"{out_dir} already exists (pass --force to replace it)")
    model_path = resolve_model(model)
    gf = GGUFFile(model_path)
    cfg = ModelConfig.from_gguf(gf)
    tokenizer = Tokenizer.from_gguf(gf)
    preset = resolve_target(options.target)
    g0, g = build_graph(gf, cfg, options, preset)
    log(f"model {model_path.name}: {cfg.arch}, {cfg.n_layers} layers, target {preset.name}")

    knob_lookup = None
    if options.tuning_db is not None:
        from ..autotune import TuningDatabase

        knob_lookup = TuningDatabase.open(options.tuning_db).lookup_for(preset.name)

    t = time.perf_counter()
    lowered = lower(g, preset, knob_lookup, max_chunk=options.max_chunk, prefetch=options.prefetch)
    timings["lower"] = time.perf_counter() - t
    t = time.perf_counter()
    executable = tvm.compile(lowered.mod, target=preset.tvm_target(), relax_pipeline=relax.pipeline.default_build_pipeline())
    timings["tvm_compile"] = time.perf_counter() - t
    log(f"compiled {len(lowered.kernels)} kernels in {timings['tvm_compile']:.1f}s")

    with atomic_directory(out_dir, replace=force) as tmp:
        t = time.perf_counter()
        executable.export_library(str(tmp / KERNELS))
        timings["link"] = time.perf_counter() - t
        t = time.perf_counter()
        table = write_weights(tmp / WEIGHTS, pack_params(gf, lowered.params))
        timings["pack_weights"] = time.perf_counter() - t
        (tmp / TOKENIZER).write_text(tokenizer.to_json())
        t = time.perf_counter()
        manifest = {
            "ellm_version": __version__,
            "tvm_version": tvm.__version__,
            "source": {"file": model_path.name, "sha256": gf.sha256(), "bytes": gf.file_size},
            "config": cfg.to_dict(),
            "target": {
                "preset": preset.name,
                "tvm": preset.target_json(),
                "required_cpu_features": compute_features(preset.llvm_features),
            },
            "kv_cache": KVPlan.from_key(g.op("kv_cache").attr("kv_plan")).to_dict(),
            "activations": pass_context(options, preset).activations,
            "prefetch": options.prefetch,
            "entries": [{"name": e.name, "tokens": e.m, "logits": "last" if e.last_only else "all"} for e in ENTRIES],
            "max_chunk": options.max_chunk,
            "decode_weight_bytes": decode_weight_bytes(g),
            "graph": {
                "passes": enabled_passes(options.disable_passes, options.enable_passes),
                "ops_imported": dict(g0.op_counts()),
                "ops": dict(g.op_counts()),
            },
            "kernels": [{"name": k.name, "rule": k.rule, "knobs": k.knobs, "request": k.request} for k in lowered.kernels],
            "params": table,
            "tokenizer": tokenizer.info.to_dict(),
        }
        write_manifest(tmp, manifest)
        timings["manifest"] = time.perf_counter() - t
    size = sum(p.stat().st_size for p in out_dir.iterdir())
    return CompileReport(out_dir, time.perf_counter() - t_start, len(lowered.kernels), size, timings)
