"""Target presets, CPU detection from simulated hosts, and cross-compiled code checked in its assembly."""

from __future__ import annotations

import numpy as np
import pytest
from kernels import runnable
from synthetic import write_model

import ellm
from ellm.compiler.build import CompileOptions, compile_model
from ellm.targets import PRESETS, HostCPU, IsaClass, compute_features, missing_features, preset_for_host, resolve_target
from ellm.targets.presets import FALLBACK_ORDER
from ellm.targets.features import host_cpuinfo_flags


def _host(flags, llvm_cpu="unknown"):
    return HostCPU("sim", llvm_cpu, frozenset(flags), 2)


def _flags(preset_name: str) -> set[str]:
    """The cpuinfo flags of a CPU that has exactly what a preset's code needs."""
    from ellm.targets.features import LLVM_TO_CPUINFO

    return {LLVM_TO_CPUINFO[f] for f in PRESETS[preset_name].required_cpu_features}


@pytest.mark.parametrize("name", FALLBACK_ORDER)
def test_preset_from_simulated_flags(name):
    """A host whose LLVM CPU has no preset gets the best preset its flags can run."""
    assert preset_for_host(_host(_flags(name))).name == name


def test_too_few_flags_fall_back_to_generic_avx2():
    assert preset_for_host(_host({"avx2", "fma"})).name == "x86-64-v3"


def test_host_record_names_the_machine_and_its_preset():
    """Benchmark JSONs carry this record, so runs from different hosts can be told apart."""
    host = HostCPU("Some Xeon", "unknown", frozenset(_flags("cascadelake")), 2, {"L3": 480 << 20})
    assert host.record() == {"model_name": "Some Xeon", "llvm_cpu": "unknown", "logical_cpus": 2,
                             "caches": {"L3": 480 << 20}, "preset": "cascadelake"}


def test_known_llvm_cpu_maps_directly():
    assert preset_for_host(_host(_flags("znver3"), "znver3")).name == "znver3"


def test_masked_features_move_the_host_down(monkeypatch):
    """ELLM_CPU_MASK hides flags: a Zen 4 without AVX-512 runs the generic AVX2 preset."""
    from ellm.targets import host_flags

    monkeypatch.setattr("ellm.targets.features.host_cpuinfo_flags", lambda path="/proc/cpuinfo": _flags("znver4"))
    monkeypatch.setenv("ELLM_CPU_MASK", "avx512*, amx*")
    flags = host_flags()
    assert "avx2" in flags and not any(f.startswith("avx512") for f in flags)
    assert preset_for_host(_host(flags, "znver4")).name == "x86-64-v3"


@pytest.mark.parametrize("name,isa", [("x86-64-v3", IsaClass.AVX2), ("haswell", IsaClass.AVX2), ("znver2", IsaClass.AVX2),
                                      ("znver3", IsaClass.AVX2), ("skylake-avx512", IsaClass.AVX2),
                                      ("alderlake", IsaClass.AVX_VNNI), ("cascadelake", IsaClass.AVX512_VNNI),
                                      ("icelake-server", IsaClass.AVX512_VNNI), ("znver4", IsaClass.AVX512_VNNI),
                                      ("znver5", IsaClass.AVX512_VNNI), ("sapphirerapids", IsaClass.AMX)])
def test_isa_class_of_each_preset_comes_from_llvm(name, isa):
    assert PRESETS[name].isa is isa
    assert PRESETS[name].vector_bits == (512 if isa >= IsaClass.AVX512_VNNI or name == "skylake-avx512" else 256)


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
    assert "vpmaddubsw" in asm and "vpdpbusd" not in asm  # the AVX2 integer kernels
    if runnable(PRESETS["znver4"]):
        native = compile_model(path, tmp_path / "z4", CompileOptions(target="znver4", cache_type_k="f32", cache_type_v="f32")).path
        assert "zmm" in _asm_of(native)
        ids = list(range(5, 30))
        a = ellm.load(v3, threads=2).logits(ids)
        b = ellm.load(native, threads=2).logits(ids)
        assert np.abs(a - b).max() <= 1e-4 * np.abs(b).max()


def _asm_of(artifact_dir) -> str:
    import subprocess

    (lib,) = artifact_dir.glob("kernels-*.so")
    out = subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(lib)], capture_output=True, text=True)
    if out.returncode != 0:
        pytest.skip("objdump unavailable")
    return out.stdout


@pytest.mark.parametrize("preset,attention_bits", [("sapphirerapids", 16), ("znver4", 16), ("cascadelake", 16),
                                                   ("skylake-avx512", 16), ("x86-64-v3", 8), ("znver3", 8),
                                                   ("alderlake", 8)])
def test_auto_activations_are_8_bit_and_attention_keeps_its_own_rounding(preset, attention_bits):
    """Steps and chunks take 8-bit activations wherever there is an integer path (verification steps round as
    one-token steps do, and are compute-bound); attention rounds to 16 bits where dot products are 512 bits
    wide, 8 with 256-bit ones."""
    from ellm.compiler.build import CompileOptions
    from ellm.compiler.compile_target import pass_context
    from ellm.compiler.pass_context import auto_activations

    target = resolve_target(preset)
    assert auto_activations(target) == ("int8", "int8")
    ctx = pass_context(CompileOptions(target=preset), target)
    assert (ctx.activations, ctx.chunk_activations, ctx.attention_bits) == ("int8", "int8", attention_bits)
    assert pass_context(CompileOptions(target=preset, activations="int8"), target).attention_bits is None
