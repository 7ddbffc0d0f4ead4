"""The VNNI integer matmuls on tile16 weights: every quantised type, M in {1, 3, 16, 64, 512}, against float64.

Tolerances (relative to the largest output): the kernels quantise activations per 32 inputs, so the
error is that rounding: 16-bit, 1/32639 of a group's largest value per element, a few 1e-5 after the
sum; 8-bit, 1/127, about 1e-2.
"""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize
from kernels import PRESET, TARGET, build, build_request, matmul_request, run
from quantizers import quantize

import tvm
from ellm.quant import QuantType
from ellm.quant.tiled import TILED_COMPONENTS, pack_tiled
from ellm.schedules.inject_prefetch import inject_prefetch

pytestmark = pytest.mark.skipif(not PRESET.vnni, reason="needs an AVX-512 VNNI target")
INT_TYPES = [QuantType.Q4_0, QuantType.Q4_1, QuantType.Q8_0, QuantType.Q4_K, QuantType.Q6_K]
RTOL = {16: 1e-4, 8: 3e-2}


def _weights(qtype, n, k, seed=0):
    rng = np.random.default_rng(seed)
    raw = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, int(qtype))
    W = dequantize(raw, G(int(qtype))).reshape(n, k).astype(np.float64)
    return pack_tiled(raw, qtype), W


def _run(qtype, n, k, m, bits, x, extra=(), norm=None, bias=None, residual=None, **req_kw):
    comps, W = _weights(qtype, n, k)
    req = matmul_request(
        qtype, n, k, m=1 if m == 1 else None, layout="tile16", act_bits=bits,
        norm=norm is not None, bias=bias is not None, residual=residual is not None, **req_kw,
    )
    rule, f = build_request(req)
    assert rule.name == ("vnni_gemv" if m == 1 else "vnni_gemm")
    args = [x] + ([residual] if residual is not None else []) + [comps[c.name] for c in TILED_COMPONENTS[qtype]]
    args += ([norm] if norm is not None else []) + ([bias] if bias is not None else [])
    rows = 1 if req_kw.get("last_row") else m
    return run(build(f), *args, np.zeros((rows, n), np.float32))[-1].numpy(), W


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("qtype", INT_TYPES, ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 3, 16, 64, 512])
def test_vnni_matmul(qtype, m, bits):
    n, k = 64, 512
    x = np.random.default_rng(m).standard_normal((m, k)).astype(np.float32)
    out, W = _run(qtype, n, k, m, bits, x)
    ref = x.astype(np.float64) @ W.T
    assert np.abs(out - ref).max() <= RTOL[bits] * np.abs(ref).max()


@pytest.mark.parametrize("m", [1, 7])
def test_vnni_prologue_epilogue_and_last_row(m):
    n, k = 48, 768
    rng = np.random.default_rng(3)
    x = rng.standard_normal((m, k)).astype(np.float32) * 4
    g, b, r = rng.standard_normal(k).astype(np.float32), rng.standard_normal(n).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
    out, W = _run(QuantType.Q4_K, n, k, m, 16, x, norm=g, bias=b, residual=r)
    x64 = x.astype(np.float64)
    ref = (x64 / np.sqrt((x64**2).mean(1, keepdims=True) + 1e-5) * g) @ W.T + b + r
    assert np.abs(out - ref).max() <= 1e-4 * np.abs(ref).max()
    last, W = _run(QuantType.Q8_0, n, k, 1, 16, x, norm=g, last_row=True)
    xl = x64[-1:]
    ref = (xl / np.sqrt((xl**2).mean() + 1e-5) * g) @ W.T
    assert np.abs(last - ref).max() <= 1e-4 * np.abs(ref).max()


def _asm(req, knobs=None, prefetch=True) -> str:
    from kernels import select_rule

    rule = select_rule(req, PRESET)
    func = inject_prefetch(rule.build(req, PRESET, rule.resolve_knobs(req, PRESET, knobs)), enabled=prefetch)
    return tvm.compile(func, target=TARGET).mod.inspect_source("asm")


def test_vpdpbusd_and_prefetch_in_assembly():
    req = matmul_request(QuantType.Q4_1, 256, 512, m=1, layout="tile16", act_bits=16)
    asm = _asm(req)
    assert asm.count("vpdpbusd") >= 16  # 8 operands per 32 inputs, two halves of each 16-bit activation
    assert "{1to16}" in asm  # activations broadcast straight from memory into vpdpbusd
    assert "prefetchnta" in asm
    assert "prefetcht0" in _asm(req, {"prefetch_nta": 0})
    off = _asm(req, prefetch=False)
    assert "prefetch" not in off and off.count("vpdpbusd") == asm.count("vpdpbusd")
