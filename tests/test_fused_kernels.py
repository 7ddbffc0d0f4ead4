"""The fused integer kernels against float64: the FFN block, and norm + QKV + RoPE + KV append."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize
from kernels import build, build_request, isa_params
from quantizers import quantize
from kvcache import cache_attrs, clear_ring_tokens, empty_state, layer_args, ring_tokens, rotated_keys
from test_kernels import _rope_ref, _table

import tvm
from ellm.compiler.graph import OpKind, TensorType
from ellm.kv.plan import KVPlan, KVType
from ellm.quant import QuantType
from ellm.quant.tiled import TILED_COMPONENTS, pack_tiled
from ellm.schedules import KernelRequest

from ellm.targets import IsaClass

CLASSES = (IsaClass.AVX2, IsaClass.AVX_VNNI, IsaClass.AVX512_VNNI)


def _weight(qtype, n, k, seed):
    raw = quantize(np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05, int(qtype))
    return [pack_tiled(raw, qtype)[c.name] for c in TILED_COMPONENTS[qtype]], dequantize(raw, G(int(qtype))).reshape(n, k)


def _norm(x, g):
    x = x.astype(np.float64)
    return x / np.sqrt((x**2).mean(1, keepdims=True) + 1e-5) * g


def ffn_request(m, D=256, F=512) -> KernelRequest:
    """The FFN block of d_model D and d_ff F: Q4_K gate/up stacked, Q6_K down, RMSNorm fused."""
    return KernelRequest(
        OpKind.FFN, 1 if m == 1 else None, (TensorType(("T", D)),), (None,), (TensorType(("T", D)),), QuantType.Q4_K,
        (2 * F, D), ("norm",), (("act_bits", 16), ("d_ff", F), ("layout", "tile16"), ("norm_eps", 1e-5)),
        ((QuantType.Q6_K, D, F, "tile16"),),
    )


def _plan(protected: bool = False) -> KVPlan:
    """2 layers, 2 KV heads of 64; `protected`: q4 keys stored rotated, the first block pinned (else f32)."""
    if protected:
        return KVPlan.uniform(2, 2, 64, KVType.Q4, KVType.Q8, max_chunk=64, pinned=1, rotate_k=True)
    return KVPlan.uniform(2, 2, 64, KVType.F32, KVType.F32, max_chunk=64)


def attention_input_request(m, neox, rope_dim, bias, plan: KVPlan | None = None) -> KernelRequest:
    """Norm + Q4_1 QKV + RoPE + KV append for 4 heads, 2 KV heads of 64, d_model 256, layer 1 of 2."""
    H, Hkv, hd, Lyr, D = 4, 2, 64, 2, 256
    plan = plan or _plan()
    cache_t = TensorType((Lyr, Hkv, "C", hd), "float16")
    return KernelRequest(
        OpKind.ATTN_INPUT, 1 if m == 1 else None, (cache_t, TensorType(("T", D))), (None, None),
        (TensorType(("T", H * hd)), cache_t), QuantType.Q4_1, ((H + 2 * Hkv) * hd, D), ("norm", "bias") if bias else ("norm",),
        tuple(sorted((("act_bits", 16), ("layout", "tile16"), ("n_heads", H), ("n_kv_heads", Hkv), ("neox", neox),
                      ("norm_eps", 1e-5), ("rope_dim", rope_dim), *cache_attrs(plan, 1)))),
    )


@pytest.mark.parametrize("preset", isa_params(*CLASSES))
@pytest.mark.parametrize("m", [1, 5])
def test_ffn(m, preset):
    assert ffn_error(m, preset) <= 1e-4


def ffn_error(m, preset, knobs=None, D=256, F=512) -> float:
    """Largest error of the fused FFN block (Q4_K gate/up, Q6_K down) against float64, relative to the
    largest output."""
    gu, Wgu = _weight(QuantType.Q4_K, 2 * F, D, 1)
    dn, Wdn = _weight(QuantType.Q6_K, D, F, 2)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((m, D)).astype(np.float32)
    g = rng.standard_normal(D).astype(np.float32)
    rule, f = build_request(ffn_request(m, D, F), knobs, preset=preset)
    assert rule.name == "int_ffn"
    ts = [tvm.runtime.tensor(a) for a in (x, *gu, *dn, g, np.zeros((m, D), np.float32))]
    build(f, preset)["int_ffn"](*ts)
    h = _norm(x, g) @ Wgu.T
    gate, up = h[:, :F], h[:, F:]
    ref = x + (gate / (1 + np.exp(-gate)) * up) @ Wdn.T
    return float(np.abs(ts[-1].numpy() - ref).max() / np.abs(ref).max())


@pytest.mark.parametrize("neox,rope_dim,bias", [(False, 64, False), (True, 64, True), (False, 32, False), (True, 32, True)])
@pytest.mark.parametrize("preset", isa_params(*CLASSES))
@pytest.mark.parametrize("m", [1, 3])
def test_attention_input(neox, rope_dim, bias, m, preset):
    assert attention_input_error(neox, rope_dim, bias, m, preset) <= 1e-4


@pytest.mark.parametrize("m", [1, 3])
def test_attention_input_rotates_quantised_keys(m):
    """A layer with rotated keys: the ring holds each key in its head's Hadamard basis; q and v as given. The
    ring is float16 here: rounding to it costs up to 2^-11 of the largest value."""
    assert attention_input_error(False, 64, True, m, None, plan=_plan(protected=True)) <= 1e-4 + 2**-11


def attention_input_error(neox, rope_dim, bias, m, preset, knobs=None, plan: KVPlan | None = None) -> float:
    """Largest error of q, k and v (norm, QKV matmul, RoPE, KV append) against float64, relative to the
    largest projection; asserts that nothing else in the KV state was written."""
    H, Hkv, hd, _, C, pos, layer, D = 4, 2, 64, 2, 64, 21, 1, 256  # 2 layers
    N = (H + 2 * Hkv) * hd
    w, W = _weight(QuantType.Q4_1, N, D, 4)
    rng = np.random.default_rng(5)
    x = rng.standard_normal((m, D)).astype(np.float32)
    g = rng.standard_normal(D).astype(np.float32)
    b = rng.standard_normal(N).astype(np.float32)
    plan = plan or _plan()
    rule, f = build_request(attention_input_request(m, neox, rope_dim, bias, plan), knobs, preset=preset)
    assert rule.name == "attention_input"
    state = [tvm.runtime.tensor(a) for a in empty_state(plan, C)]
    args = [x, *w, g] + ([b] if bias else []) + [_table(C, 10000.0, rope_dim)]
    ts = [tvm.runtime.tensor(a) for a in args]
    q = tvm.runtime.tensor(np.zeros((m, H * hd), np.float32))
    build(f, preset)["attention_input"](*layer_args(plan, layer, state), *ts, pos, layer, layer, layer, q)
    qkv = _norm(x, g) @ W.T + (b if bias else 0)
    positions = np.arange(pos, pos + m, dtype=np.float64)
    q_ref = _rope_ref(qkv[:, : H * hd].reshape(m, H, hd), positions, 10000.0, rope_dim, neox).reshape(m, -1)
    k_ref = _rope_ref(qkv[:, H * hd : (H + Hkv) * hd].reshape(m, Hkv, hd), positions, 10000.0, rope_dim, neox)
    k_ref = rotated_keys(plan, layer, k_ref)
    v_ref = qkv[:, (H + Hkv) * hd :].reshape(m, Hkv, hd)
    st = [t.numpy() for t in state]
    k_out, v_out = ring_tokens(plan, st, layer, range(pos, pos + m))
    err = max(np.abs(q.numpy() - q_ref).max(), np.abs(k_out - k_ref).max(), np.abs(v_out - v_ref).max())
    clear_ring_tokens(plan, st, layer, range(pos, pos + m))
    assert np.isnan(st[0]).all() and np.isnan(st[1]).all()  # nothing else written
    return float(err / np.abs(qkv).max())
