"""Multi-target artifacts: one weights file shared by a kernel library per target; the runtime runs the best
target this CPU has, the next one when that is masked out, and refuses a CPU that has none."""

from __future__ import annotations

import json

import numpy as np
import pytest
from kernels import runnable
from synthetic import write_model

import ellm
from ellm.compiler.build import CompileOptions, compile_model
from ellm.errors import ArtifactError
from ellm.runtime.artifact import Artifact
from ellm.targets import PRESETS

# Best first, whatever order they are given in: AVX-512 VNNI, AVX-VNNI, AVX2.
TARGETS = "x86-64-v3,znver4,alderlake"


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    model = write_model(tmp_path_factory.mktemp("m") / "m.gguf", n_layers=2)
    out = tmp_path_factory.mktemp("a") / "fleet"
    report = compile_model(model, out, CompileOptions(target=TARGETS, cache_type_k="f16", cache_type_v="f16"))
    return out, report


def test_targets_ordered_best_first_sharing_every_weight(fleet):
    path, report = fleet
    manifest = json.loads((path / "manifest.json").read_text())
    names = [t["preset"] for t in manifest["targets"]]
    assert names == report.targets == ["znver4", "alderlake", "x86-64-v3"]
    assert [t["isa"] for t in manifest["targets"]] == ["AVX-512 VNNI", "AVX-VNNI", "AVX2"]
    # every integer class reads the same tile16 weights: one array each, used by all three targets
    assert all(t["params"] == manifest["targets"][0]["params"] for t in manifest["targets"])
    assert len(manifest["params"]) == len(manifest["targets"][0]["params"])
    assert report.shared_bytes == sum(p["nbytes"] for p in manifest["params"])
    for t in manifest["targets"]:
        assert (path / t["kernels_file"]).is_file() and t["kernels_file"] in manifest["files"]


def _runnable_targets(path) -> list[str]:
    return [n for n in Artifact.open(path, check_cpu=False).target_names if runnable(PRESETS[n])]


def test_loads_the_best_target_then_the_next_when_masked(fleet, monkeypatch):
    path, _ = fleet
    names = _runnable_targets(path)
    if len(names) < 2:
        pytest.skip(f"this CPU runs {len(names)} of the artifact's targets")
    ids = list(range(3, 40))
    best = ellm.load(path, threads=2, ctx_size=64)
    assert best.target == names[0]
    a = best.logits(ids)
    # hide what the best target needs beyond the next one: the runtime takes the next
    mask = {"znver4": "avx512*", "alderlake": "avx_vnni"}[names[0]]
    monkeypatch.setenv("ELLM_CPU_MASK", mask)
    nxt = ellm.load(path, threads=2, ctx_size=64)
    assert nxt.target == names[1]
    b = nxt.logits(ids)
    # both classes sum the same integers exactly; only float32 summation order differs
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()


def test_named_target_and_refusal(fleet):
    path, _ = fleet
    art = Artifact.open(path, check_cpu=False)
    with pytest.raises(ArtifactError, match="znver4 needs .*avx512.*x86-64-v3 needs .*avx2"):
        art.check_cpu(host_flags={"sse2", "sse4_1", "sse4_2"})
    with pytest.raises(ArtifactError, match="no target 'haswell'"):
        Artifact.open(path, target="haswell")
    if runnable(PRESETS["x86-64-v3"]):
        assert Artifact.open(path, target="x86-64-v3").target["preset"] == "x86-64-v3"
