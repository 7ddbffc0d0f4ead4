"""The artifact: manifest contents, page-aligned weights mapped without copies, loading without compiling."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ellm.fsutil import sha256_file
from ellm.runtime.artifact import PAGE, Artifact


@pytest.fixture(scope="module")
def manifest(artifact):
    return json.loads((artifact / "manifest.json").read_text())


def test_manifest_records_source_target_and_files(manifest, artifact, model_path):
    assert manifest["format"] == "ellm-artifact" and manifest["format_version"] == 5
    assert {e["name"]: e["numerics"] for e in manifest["entries"]} == {
        "prefill_all": "chunks", "prefill": "chunks", "decode": "steps", "verify": "steps"}
    assert manifest["max_verify"] == 32
    assert manifest["source"]["sha256"] == sha256_file(model_path)
    assert manifest["config"]["n_layers"] == 30 and manifest["config"]["arch"] == "llama"
    (target,) = manifest["targets"]
    assert target["tvm"]["kind"] == "llvm" and target["tvm"]["mcpu"]
    assert "avx2" in target["required_cpu_features"]
    assert target["params"] == list(range(len(manifest["params"])))
    rules = {k["rule"] for k in target["kernels"]}
    if target["activations"] != "f32":  # the integer rules of the target's dot-product class
        assert {"attention_input"} <= rules and any(r.endswith("_gemv") and r != "gemv" for r in rules)
    else:
        assert {"gemv", "gemm", "rope_kv_append", "silu_mul"} <= rules
    assert rules >= {"attention", "attention_decode", "embedding"}
    assert set(manifest["files"]) == {target["kernels_file"], "weights.bin", "tokenizer.json"}
    for name, digest in manifest["files"].items():
        assert sha256_file(artifact / name) == digest


def test_weights_are_page_aligned_and_packed_4_bit(manifest, artifact):
    size = (artifact / "weights.bin").stat().st_size
    assert size % PAGE == 0
    for p in manifest["params"]:
        assert p["offset"] % PAGE == 0
        assert p["offset"] + p["nbytes"] <= size
    qs = {p["name"]: p for p in manifest["params"] if p["qtype"] == "Q4_1" and p["component"] == "qs"}
    ffn = qs["blk.0.ffn_gate+ffn_up.weight:qs"]
    assert ffn["nbytes"] * 2 == 3072 * 576  # 4 bits per weight, in any layout
    if ffn["layout"] == "tile16":
        assert ffn["shape"] == [3072 // 16, 576 // 8, 16] and ffn["dtype"] == "uint32"  # [tiles, octets, lanes]
    else:
        assert ffn["shape"] == [3072, 288]


def test_params_are_mapped_not_copied(engine):
    import tvm

    arrays = engine.artifact.map_params()
    assert isinstance(arrays[0].base, np.memmap) or isinstance(arrays[0], np.memmap)
    t = tvm.runtime.from_dlpack(arrays[5])
    assert np.from_dlpack(t).ctypes.data == arrays[5].ctypes.data


def test_params_on_huge_pages_equal_the_mapped_ones(engine):
    """The engine's default: the weights read into 2 MiB pages, each array where the file has it."""
    mapped, huge = engine.artifact.map_params(), engine.artifact.map_params(huge_pages=True)
    start = huge[0].ctypes.data - engine.artifact.params[0].offset
    assert start % (2 << 20) == 0
    for m, h, p in zip(mapped, huge, engine.artifact.params):
        assert h.ctypes.data - start == p.offset and h.dtype == m.dtype and h.shape == m.shape
        assert np.array_equal(h, m)


def test_loading_never_compiles(artifact, monkeypatch):
    import tvm

    import ellm

    def no_compile(*a, **k):
        raise AssertionError("load must not compile")

    monkeypatch.setattr(tvm, "compile", no_compile)
    monkeypatch.setattr(tvm.relax, "build", no_compile)
    eng = ellm.load(artifact, threads=1, ctx_size=64)
    assert eng.generate(eng.tokenizer.encode("Hello"), 2, stop_at_eog=False)


def test_cpu_check_names_missing_features(artifact):
    from ellm.errors import ArtifactError

    from ellm.targets.features import LLVM_TO_CPUINFO

    art = Artifact.open(artifact, verify=False, check_cpu=False)
    with pytest.raises(ArtifactError, match="avx2"):
        art.check_cpu(host_flags={"sse2", "sse4_1"})
    needed = {LLVM_TO_CPUINFO[f] for f in art.target["required_cpu_features"]}
    art.check_cpu(host_flags=needed)
    with pytest.raises(ArtifactError, match="fma"):
        art.check_cpu(host_flags=needed - {"fma"})


def test_kv_cache_is_persistent_and_sized_by_ctx(engine):
    cfg, plan = engine.config, engine.kv_plan
    f16_cache = 2 * cfg.n_layers * cfg.n_kv_heads * engine.ctx_size * cfg.head_dim * 2
    summary = cfg.n_layers * cfg.n_kv_heads * plan.n_blocks(engine.ctx_size) * 2 * cfg.head_dim * 2  # per-channel min, max
    ring = 2 * cfg.n_layers * cfg.n_kv_heads * plan.ring * plan.block * cfg.head_dim * 2
    assert engine.kv_bytes() == f16_cache + summary + ring
