"""The integer matmuls on tile16 weights for every dot-product class (AVX2, AVX-VNNI, AVX-512 VNNI): every
quantised type and M in {1, 3, 16, 64, 512} against float64, the worst cases of vpmaddubsw's int16
saturation, extreme scales, and each class's instructions in the assembly of its target.

Tolerances (relative to the largest output): the kernels quantise activations per 32 inputs, so the
error is that rounding: 16-bit, 1/32639 of a group's largest value per element, a few 1e-5 after the
sum; 8-bit, 1/127, about 1e-2. The integer sums themselves are exact, so every class gives the same
result bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize
from kernels import ISA_PRESETS, asm, build, build_request, isa_params, matmul_request, run
from quantizers import quantize

from ellm.quant import FORMATS, QuantType
from ellm.quant.tiled import TILED_COMPONENTS, pack_tiled
from ellm.schedules.intdot import Dot
from ellm.targets import IsaClass

INT_TYPES = [QuantType.Q4_0, QuantType.Q4_1, QuantType.Q8_0, QuantType.Q4_K, QuantType.Q6_K]
CLASSES = (IsaClass.AVX2, IsaClass.AVX_VNNI, IsaClass.AVX512_VNNI)
RULE_PREFIX = {IsaClass.AVX2: "avx2", IsaClass.AVX_VNNI: "avxvnni", IsaClass.AVX512_VNNI: "vnni"}
RTOL = {16: 1e-4, 8: 3e-2}


def _weights(qtype, n, k, seed=0):
    rng = np.random.default_rng(seed)
    raw = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, int(qtype))
    return raw, dequantize(raw, G(int(qtype))).reshape(n, k).astype(np.float64)


def _run(preset, raw, qtype, n, k, m, bits, x, norm=None, bias=None, residual=None, knobs=None, **req_kw):
    req = matmul_request(
        qtype, n, k, m=1 if m == 1 else None, layout="tile16", act_bits=bits,
        norm=norm is not None, bias=bias is not None, residual=residual is not None, **req_kw,
    )
    rule, f = build_request(req, knobs, preset=preset)
    assert rule.name == f"{RULE_PREFIX[preset.isa if preset.isa is not IsaClass.AMX else IsaClass.AVX512_VNNI]}_{'gemv' if m == 1 else 'gemm'}"
    comps = pack_tiled(raw, qtype)
    args = [x] + ([residual] if residual is not None else []) + [comps[c.name] for c in TILED_COMPONENTS[qtype]]
    args += ([norm] if norm is not None else []) + ([bias] if bias is not None else [])
    rows = 1 if req_kw.get("last_row") else m
    return run(build(f, preset), *args, np.zeros((rows, n), np.float32), name="int_matmul")[-1].numpy()


@pytest.mark.parametrize("preset", isa_params(*CLASSES))
@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("qtype", INT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 3, 16, 64, 512])
def test_int_matmul(preset, qtype, m, bits):
    assert int_matmul_error(preset, qtype, m, bits) <= RTOL[bits]


def int_matmul_error(preset, qtype, m, bits, knobs=None, n=64, k=512) -> float:
    """Largest error of the integer matmul against float64 (x @ W.T), relative to the largest output."""
    raw, W = _weights(qtype, n, k)
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    out = _run(preset, raw, qtype, n, k, m, bits, x, knobs=knobs)
    ref = x.astype(np.float64) @ W.T
    return float(np.abs(out - ref).max() / np.abs(ref).max())


def _extreme_blocks(qtype: QuantType, n: int, k: int, rng) -> np.ndarray:
    """GGUF blocks whose codes are all at their maximum (every quant bit set), with scales spanning float16:
    row r's scale is 2**e for e from -14 to 15. Q4_K's 6-bit scales and mins are all 63; Q6_K's int8
    scales are 127 in even rows and -128 in odd ones."""
    fmt = FORMATS[qtype]
    nb = k // fmt.block
    raw = np.full((n, nb, fmt.block_bytes), 0xFF, np.uint8)
    exps = np.linspace(-14, 15, n).round()
    d = (2.0 ** exps).astype(np.float16).view(np.uint8).reshape(n, 1, 2)
    if qtype in (QuantType.Q4_0, QuantType.Q8_0):
        raw[:, :, 0:2] = d
    elif qtype is QuantType.Q4_1:
        raw[:, :, 0:2] = d
        raw[:, :, 2:4] = (-np.minimum(2.0 ** exps * 8, 32768.0)).astype(np.float16).view(np.uint8).reshape(n, 1, 2)
    elif qtype is QuantType.Q4_K:
        raw[:, :, 0:2] = d
        raw[:, :, 2:4] = d
    elif qtype is QuantType.Q6_K:
        raw[:, :, 192:208] = np.where(np.arange(n) % 2 == 0, 127, -128).astype(np.int8).view(np.uint8)[:, None, None]
        raw[:, :, 208:210] = d
    if qtype is QuantType.Q8_0:  # codes 127 (stored +128: 255), the largest byte
        raw[:, :, 2:] = 127
    return raw.reshape(n, nb * fmt.block_bytes)


def _saturating_acts(m: int, k: int, bits: int) -> np.ndarray:
    """Activations whose quantised halves are as negative as possible everywhere: 8-bit, every value -127;
    16-bit, one value per 32 at -32639 and the rest at -32384 (low byte -128, high byte -126)."""
    x = -np.ones((m, k), np.float32)
    if bits == 16:
        x = np.full((m, k), -32384 / 32639, np.float32)
        x[:, ::32] = -1.0
    return x


@pytest.mark.parametrize("preset", isa_params(*CLASSES))
@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("qtype", INT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 3])
def test_int_matmul_worst_case_inputs(preset, qtype, m, bits):
    """All-max codes against the most negative activation halves: every vpmaddubsw pair at its bound
    (2 * 128 * cmax), the int16 partial sums at theirs; per-row scales from 2**-14 to 2**15. Per row,
    the output stays within the activation rounding of float64 (here the activations are exact)."""
    n, k = 32, 512
    raw = _extreme_blocks(qtype, n, k, np.random.default_rng(0))
    W = dequantize(raw, G(int(qtype))).reshape(n, k).astype(np.float64)
    x = _saturating_acts(m, k, bits)
    out = _run(preset, raw, qtype, n, k, m, bits, x)
    ref = x.astype(np.float64) @ W.T
    assert np.all(np.abs(out - ref) <= 1e-5 * np.abs(ref) + 1e-30), np.abs(out - ref).max()


@pytest.mark.parametrize("preset", isa_params(IsaClass.AVX2))
def test_worst_case_breaks_past_the_int16_bound(preset, monkeypatch):
    """The worst case has teeth: summing 3 Q6_K results in int16 (the bound allows 2) saturates, so the
    kernel misses the reference."""
    monkeypatch.setattr(Dot, "depth", staticmethod(lambda cmax: 3 if cmax == 63 else 8))
    n, k = 32, 512
    raw = _extreme_blocks(QuantType.Q6_K, n, k, np.random.default_rng(0))
    W = dequantize(raw, G.Q6_K).reshape(n, k).astype(np.float64)
    x = _saturating_acts(1, k, 8)
    out = _run(preset, raw, QuantType.Q6_K, n, k, 1, 8, x)
    ref = x.astype(np.float64) @ W.T
    assert np.abs(out - ref).max() > 1e-3 * np.abs(ref).max()


def test_int16_depth_bound():
    """What GroupSum may add in int16 before widening: the bound that keeps vpmaddubsw exact."""
    assert Dot.depth(15) == 8 and Dot.depth(63) == 2
    for cmax in (15, 63):
        assert Dot.depth(cmax) * 2 * 128 * cmax <= 32767 < (Dot.depth(cmax) + 1) * 2 * 128 * cmax
    with pytest.raises(ValueError):
        Dot.depth(255)


@pytest.mark.parametrize("preset", isa_params(*CLASSES))
@pytest.mark.parametrize("m", [1, 7])
def test_int_prologue_epilogue_and_last_row(preset, m):
    n, k = 48, 768
    rng = np.random.default_rng(3)
    x = rng.standard_normal((m, k)).astype(np.float32) * 4
    g, b, r = rng.standard_normal(k).astype(np.float32), rng.standard_normal(n).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
    raw, W = _weights(QuantType.Q4_K, n, k)
    out = _run(preset, raw, QuantType.Q4_K, n, k, m, 16, x, norm=g, bias=b, residual=r)
    x64 = x.astype(np.float64)
    ref = (x64 / np.sqrt((x64**2).mean(1, keepdims=True) + 1e-5) * g) @ W.T + b + r
    assert np.abs(out - ref).max() <= 1e-4 * np.abs(ref).max()
    raw, W = _weights(QuantType.Q8_0, n, k)
    last = _run(preset, raw, QuantType.Q8_0, n, k, 1, 16, x, norm=g, last_row=True)
    xl = x64[-1:]
    ref = (xl / np.sqrt((xl**2).mean() + 1e-5) * g) @ W.T
    assert np.abs(last - ref).max() <= 1e-4 * np.abs(ref).max()


def _asm(preset, req, knobs=None, prefetch=True) -> str:
    from kernels import select_rule

    rule = select_rule(req, preset)
    return asm(rule.build_kernel(req, preset, rule.resolve_knobs(req, preset, knobs), prefetch=prefetch), preset)


def _count(text: str, mnemonic: str, reg: str) -> int:
    return sum(1 for line in text.splitlines() if mnemonic in line and reg in line)


def test_avx512_vnni_assembly():
    preset = ISA_PRESETS[IsaClass.AVX512_VNNI]
    req = matmul_request(QuantType.Q4_1, 256, 512, m=1, layout="tile16", act_bits=16)
    text = _asm(preset, req)
    assert _count(text, "vpdpbusd", "zmm") >= 16  # 8 operands per 32 inputs, two halves of each 16-bit activation
    assert "{1to16}" in text  # activations broadcast straight from memory into vpdpbusd
    assert "prefetch" in text
    off = _asm(preset, req, prefetch=False)
    assert "prefetch" not in off and off.count("vpdpbusd") == text.count("vpdpbusd")


@pytest.mark.parametrize("qtype", INT_TYPES, ids=lambda q: q.name)
def test_avx_vnni_assembly(qtype):
    """alderlake: the VEX-encoded 256-bit vpdpbusd, no zmm register anywhere."""
    text = _asm(ISA_PRESETS[IsaClass.AVX_VNNI], matmul_request(qtype, 64, 512, m=1, layout="tile16", act_bits=16))
    assert "{vex}\tvpdpbusd" in text and _count(text, "vpdpbusd", "ymm") >= 16
    assert "zmm" not in text and "vpmaddubsw" not in text


@pytest.mark.parametrize("qtype", INT_TYPES, ids=lambda q: q.name)
def test_avx2_assembly(qtype):
    """x86-64-v3: vpmaddubsw + vpmaddwd on ymm, no VNNI and no zmm."""
    text = _asm(ISA_PRESETS[IsaClass.AVX2], matmul_request(qtype, 64, 512, m=1, layout="tile16", act_bits=16))
    assert _count(text, "vpmaddubsw", "ymm") >= 16 and _count(text, "vpmaddwd", "ymm") >= 4
    assert "vpdpbusd" not in text and "zmm" not in text


def test_avx2_class_on_avx512bw_runs_on_zmm():
    """skylake-avx512 has no VNNI but AVX-512 BW: the AVX2 sequence on zmm."""
    from ellm.targets import get_preset

    text = _asm(get_preset("skylake-avx512"), matmul_request(QuantType.Q4_K, 64, 512, m=1, layout="tile16", act_bits=16))
    assert _count(text, "vpmaddubsw", "zmm") >= 8 and "vpdpbusd" not in text
