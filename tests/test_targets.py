"""Target presets, CPU detection from simulated hosts, and cross-compiled code checked in its assembly."""

from __future__ import annotations

import numpy as np
import pytest
from synthetic import write_model

import ellm
from ellm.compiler.build import CompileOptions, compile_model
from ellm.targets import PRESETS, HostCPU, compute_features, missing_features, preset_for_host
from ellm.targets.features import host_cpuinfo_flags


def _host(flags, llvm_cpu="unknown"):
    return HostCPU("sim", llvm_cpu, frozenset(flags), 2)


@pytest.mark.parametrize(
    "flags,expected",
    [
        ({"avx2", "fma"}, "x86-64-v3"),
        ({"avx2", "avx512f", "avx512bw"}, "skylake-avx512"),
        ({"avx512f", "avx512_vnni"}, "icelake-server"),
        ({"avx512f", "avx512_vnni", "avx512_bf16"}, "znver4"),
        ({"avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8"}, "sapphirerapids"),
    ],
)
def test_preset_from_simulated_flags(flags, expected):
    assert preset_for_host(_host(flags)).name == expected


def test_known_llvm_cpu_maps_directly():
    assert preset_for_host(_host(set(), "znver3")).name == "znver3"


def test_required_features_per_preset():
    amx = compute_features(PRESETS["sapphirerapids"].llvm_features)
    assert {"amx-int8", "amx-tile", "avx512vnni"} <= set(amx)
    v3 = compute_features(PRESETS["x86-64-v3"].llvm_features)
    assert "avx2" in v3 and not any(f.startswith("avx512") for f in v3)
    assert missing_features(v3, {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "abm", "movbe", "popcnt", "sse4_1", "sse4_2"}) == []


def test_cpuinfo_parsing(tmp_path):
    f = tmp_path / "cpuinfo"
    f.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f\n\nprocessor\t: 1\nflags\t\t: fpu\n")
    assert host_cpuinfo_flags(f) == {"fpu", "avx2", "avx512f"}


def test_generic_v3_artifact_uses_no_avx512_and_runs_here(tmp_path):
    path = write_model(tmp_path / "m.gguf")
    v3 = compile_model(path, tmp_path / "v3", CompileOptions(target="x86-64-v3", cache_type_k="f32", cache_type_v="f32")).path
    asm = _asm_of(v3)
    assert "ymm" in asm and "zmm" not in asm
    if "avx512f" in host_cpuinfo_flags():
        native = compile_model(path, tmp_path / "z4", CompileOptions(target="znver4", cache_type_k="f32", cache_type_v="f32")).path
        assert "zmm" in _asm_of(native)
        ids = list(range(5, 30))
        a = ellm.load(v3, threads=2).logits(ids)
        b = ellm.load(native, threads=2).logits(ids)
        assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


def _asm_of(artifact_dir) -> str:
    import subprocess

    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(artifact_dir / "kernels.so")], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("objdump unavailable")
    return out.stdout
