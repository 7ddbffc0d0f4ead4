"""AMX prefill kernels: layouts and scaling checked on a software model of the tile unit; code generation
checked in Sapphire Rapids assembly; the real instructions run only where the CPU has AMX."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize
from kernels import PRESET, asm, build, matmul_request, needs, run
from quantizers import quantize

from ellm.quant import QuantType
from ellm.quant.tiled import TILED_COMPONENTS, pack_tiled
from ellm.schedules import select_rule
from ellm.schedules.amx import build_amx_matmul
from ellm.schedules.intdot import dot_for
from ellm.targets import get_preset

SPR = get_preset("sapphirerapids")
TYPES = [QuantType.Q4_0, QuantType.Q4_1, QuantType.Q8_0, QuantType.Q4_K, QuantType.Q6_K]


def _case(qtype, bits, m=37, n=32, k=512, seed=0):
    rng = np.random.default_rng(seed)
    raw = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, int(qtype))
    W = dequantize(raw, G(int(qtype))).reshape(n, k).astype(np.float64)
    x = rng.standard_normal((m, k)).astype(np.float32)
    r = rng.standard_normal((m, n)).astype(np.float32)
    req = matmul_request(qtype, n, k, m=None, layout="tile16", act_bits=bits, residual=True)
    args = [x, r, *[pack_tiled(raw, qtype)[c.name] for c in TILED_COMPONENTS[qtype]], np.zeros((m, n), np.float32)]
    return req, args, x.astype(np.float64) @ W.T + r


@pytest.mark.parametrize("bits", [16, 8])
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_amx_kernel_on_software_tiles(qtype, bits):
    """37 tokens: two 16-token AMX tiles and 5 tokens on the integer tail (the host's dot products)."""
    req, args, ref = _case(qtype, bits)
    out = run(build(build_amx_matmul(req, emulate=True, tail=dot_for(PRESET))), *args, name="amx_matmul")[-1].numpy()
    assert np.abs(out - ref).max() <= (1e-4 if bits == 16 else 3e-2) * np.abs(ref).max()


@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_amx_instructions_in_assembly(qtype):
    req, _, _ = _case(qtype, 16)
    rule = select_rule(req, SPR)
    assert rule.name == "amx_gemm"
    text = asm(rule.build(req, SPR, {}), SPR)
    for ins in ("ldtilecfg", "tileloadd", "tdpbsud", "tilestored", "tilerelease"):
        assert ins in text, ins


@needs(SPR)
@pytest.mark.parametrize("qtype", TYPES, ids=lambda q: q.name)
def test_amx_kernel_on_hardware(qtype):
    from ellm.runtime.amx import request_amx_permission

    request_amx_permission()
    req, args, ref = _case(qtype, 16)
    ex = build(build_amx_matmul(req), SPR)
    out = run(ex, *args, name="amx_matmul")[-1].numpy()
    assert np.abs(out - ref).max() <= 1e-4 * np.abs(ref).max()
