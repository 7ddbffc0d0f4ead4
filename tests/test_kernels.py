"""Every kernel against float64 NumPy on small shapes (tolerances: float32 rounding of the reductions)."""

from __future__ import annotations


import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize
from kvcache import cache_attrs, clear_ring_tokens, empty_state, layer_args, ring_tokens, rotated_keys
from kernels import build, build_request, matmul_request, run
from quantizers import quantize

from ellm.kv.plan import KVPlan, KVType
from ellm.compiler.graph import OpKind, TensorType
from ellm.quant import FORMATS, QuantType, pack_rows
from ellm.schedules import KernelRequest

RTOL = 2e-6  # float32 dot products of a few hundred terms, relative to the largest output


def _weights(qtype, n, k, seed=0):
    rng = np.random.default_rng(seed)
    raw = quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, int(qtype))
    W = dequantize(raw, G(int(qtype))).reshape(n, k).astype(np.float64)
    return pack_rows(raw, qtype), W


@pytest.mark.parametrize("qtype", list(FORMATS), ids=lambda q: q.name)
@pytest.mark.parametrize("m", [1, 3, 16, 64])
def test_matmul_all_types(qtype, m):
    n, k = 48, 512
    comps, W = _weights(qtype, n, k)
    fmt = FORMATS[qtype]
    x = np.random.default_rng(1).standard_normal((m, k)).astype(np.float32)
    # m=1 builds the static GEMV; other m use the symbolic-token GEMM kernel.
    _, f = build_request(matmul_request(qtype, n, k, m=1 if m == 1 else None))
    out = run(build(f), x, *[comps[c.name] for c in fmt.components], np.zeros((m, n), np.float32))[-1].numpy()
    ref = x.astype(np.float64) @ W.T
    assert np.abs(out - ref).max() <= RTOL * np.abs(ref).max() * 10


@pytest.mark.parametrize("m", [1, 7, 512])
@pytest.mark.parametrize("qtype", [QuantType.Q4_1, QuantType.Q6_K])
def test_matmul_prologue_epilogue(qtype, m):
    """Fused RMSNorm prologue, bias and residual epilogue."""
    n, k = 64, 512
    comps, W = _weights(qtype, n, k, seed=2)
    fmt = FORMATS[qtype]
    rng = np.random.default_rng(3)
    x = rng.standard_normal((m, k)).astype(np.float32) * 3
    r = rng.standard_normal((m, n)).astype(np.float32)
    g = rng.standard_normal(k).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    req = matmul_request(qtype, n, k, m=1 if m == 1 else None, norm=True, bias=True, residual=True)
    _, f = build_request(req)
    args = [x, r, *[comps[c.name] for c in fmt.components], g, b, np.zeros((m, n), np.float32)]
    out = run(build(f), *args)[-1].numpy()
    x64 = x.astype(np.float64)
    xn = x64 / np.sqrt((x64**2).mean(1, keepdims=True) + 1e-5) * g
    ref = xn @ W.T + b + r
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


def test_lm_head_last_row():
    """The last-logits variant projects only the last token's row of a [T, K] input."""
    n, k, t = 96, 512, 9
    comps, W = _weights(QuantType.Q8_0, n, k)
    x = np.random.default_rng(4).standard_normal((t, k)).astype(np.float32)
    g = np.ones(k, np.float32)
    req = matmul_request(QuantType.Q8_0, n, k, m=1, norm=True, last_row=True, kind=OpKind.LM_HEAD)
    _, f = build_request(req)
    out = run(build(f), x, comps["qs"], comps["d"], g, np.zeros((1, n), np.float32))[-1].numpy()
    xl = x[-1:].astype(np.float64)
    ref = (xl / np.sqrt((xl**2).mean() + 1e-5)) @ W.T
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()


def _rope_ref(x, positions, base, rope_dim, neox):
    half = rope_dim // 2
    inv = base ** (-np.arange(half) * 2.0 / rope_dim)
    ang = positions[:, None] * inv[None, :]
    cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]
    y = x.astype(np.float64).copy()
    i0 = np.arange(half) if neox else 2 * np.arange(half)
    i1 = i0 + half if neox else i0 + 1
    a, b = y[..., i0].copy(), y[..., i1].copy()
    y[..., i0], y[..., i1] = a * cos - b * sin, a * sin + b * cos
    return y


def _table(ctx, base, rope_dim):
    from ellm.config import ModelConfig, RopeScaling

    cfg = ModelConfig("llama", 1, 64, 1, 1, 64, 64, 10, ctx, 1e-5, base, rope_dim, False, RopeScaling(), (), False, True)
    from ellm.runtime.rope import rope_table

    return rope_table(cfg, ctx)


@pytest.mark.parametrize("neox,rope_dim,protected", [(False, 64, False), (True, 64, False), (False, 32, False),
                                                   (True, 48, False), (False, 64, True)])
def test_rope_kv_append(neox, rope_dim, protected):
    """The fused kernel: rotated q out, rotated k and raw v written into the cache at pos..pos+T-1.
    `protected`: q4 keys, stored in each head's Hadamard basis, and the first block pinned in the ring."""
    import tvm

    H, Hkv, hd, L, C, T, pos, layer = 4, 2, 64, 3, 128, 5, 61, 2  # positions 61..65 straddle a block boundary
    W = (H + 2 * Hkv) * hd
    if protected:
        plan = KVPlan.uniform(L, Hkv, hd, KVType.Q4, KVType.F16, max_chunk=64, pinned=1, rotate_k=True)
    else:
        plan = KVPlan.uniform(L, Hkv, hd, KVType.F32, KVType.F32, max_chunk=64)
    cache_t = TensorType((L, Hkv, "C", hd), "float16")
    req = KernelRequest(
        OpKind.ROPE_KV_APPEND,
        None,
        (cache_t, TensorType(("T", W))),
        (None, None),
        (TensorType(("T", H * hd)), cache_t),
        attrs=tuple(sorted((("n_heads", H), ("n_kv_heads", Hkv), ("neox", neox), ("rope_dim", rope_dim), *cache_attrs(plan, layer)))),
    )
    _, f = build_request(req)
    rng = np.random.default_rng(5)
    qkv = rng.standard_normal((T, W)).astype(np.float32)
    tab = _table(C, 10000.0, rope_dim)
    state = [tvm.runtime.tensor(a) for a in empty_state(plan, C)]
    ts = [tvm.runtime.tensor(a) for a in (qkv, tab, np.zeros((T, H * hd), np.float32))]
    build(f)["rope_kv_append"](*layer_args(plan, layer, state), ts[0], ts[1], pos, layer, layer, layer, ts[2])
    positions = np.arange(pos, pos + T, dtype=np.float64)
    q_ref = _rope_ref(qkv[:, : H * hd].reshape(T, H, hd), positions, 10000.0, rope_dim, neox).reshape(T, -1)
    k_ref = _rope_ref(qkv[:, H * hd : (H + Hkv) * hd].reshape(T, Hkv, hd), positions, 10000.0, rope_dim, neox)
    k_ref = rotated_keys(plan, layer, k_ref)
    v_ref = qkv[:, (H + Hkv) * hd :].reshape(T, Hkv, hd)
    assert np.abs(ts[2].numpy() - q_ref).max() < 1e-5  # q as RoPE leaves it: attention rotates its own copy
    st = [t.numpy() for t in state]
    k_out, v_out = ring_tokens(plan, st, layer, range(pos, pos + T))
    tol = 1e-5 if not protected else 2**-11 * np.abs(k_ref).max()  # float16 ring: half an ulp
    assert np.abs(k_out - k_ref).max() < tol
    np.testing.assert_array_equal(v_out, v_ref.astype(plan.ring_dtype))
    if not protected:  # the completed block 0 (positions 0..63) aged into the store
        np.testing.assert_array_equal(st[2][layer, :, 0, 3, :, 13:16], st[0][layer, :, 0, 3, :, 13:16])
    # nothing else in the ring was written
    clear_ring_tokens(plan, st, layer, range(pos, pos + T))
    assert np.isnan(st[0]).all() and np.isnan(st[1]).all()


@pytest.mark.parametrize("neox", [False, True])
def test_rope_and_kv_append_unfused(neox):
    import tvm

    Hkv, hd, L, C, T, pos = 2, 64, 2, 32, 3, 4
    x = np.random.default_rng(6).standard_normal((T, 3 * Hkv * hd)).astype(np.float32)
    rope_req = KernelRequest(
        OpKind.ROPE, None, (TensorType(("T", x.shape[1])),), ((Hkv * hd, 2 * Hkv * hd),), (TensorType(("T", Hkv * hd)),),
        attrs=(("n_heads", Hkv), ("neox", neox), ("rope_dim", hd)),
    )
    _, f = build_request(rope_req)
    tab = _table(C, 500.0, hd)
    ts = [tvm.runtime.tensor(a) for a in (x, tab, np.zeros((T, Hkv * hd), np.float32))]
    build(f)["rope"](ts[0], ts[1], pos, ts[2])
    ref = _rope_ref(x[:, Hkv * hd : 2 * Hkv * hd].reshape(T, Hkv, hd), np.arange(pos, pos + T, dtype=np.float64), 500.0, hd, neox)
    assert np.abs(ts[2].numpy() - ref.reshape(T, -1)).max() < 1e-5

    plan = KVPlan.uniform(L, Hkv, hd, KVType.F16, KVType.F16, max_chunk=64)
    cache_t = TensorType((L, Hkv, "C", hd), "float16")
    kv_req = KernelRequest(
        OpKind.KV_APPEND, None, (cache_t, TensorType(("T", Hkv * hd)), TensorType(("T", x.shape[1]))),
        (None, None, (2 * Hkv * hd, 3 * Hkv * hd)), (cache_t,), attrs=cache_attrs(plan, 1),
    )
    _, f = build_request(kv_req)
    k = ts[2].numpy()
    state = [tvm.runtime.tensor(a) for a in empty_state(plan, C)]
    build(f)["kv_append"](*layer_args(plan, 1, state), tvm.runtime.tensor(k), tvm.runtime.tensor(x), pos, 1, 1, 1)
    st = [t.numpy() for t in state]
    k_out, v_out = ring_tokens(plan, st, 1, range(pos, pos + T))
    np.testing.assert_array_equal(k_out, k.reshape(T, Hkv, hd).astype(np.float16))
    np.testing.assert_array_equal(v_out, x[:, 2 * Hkv * hd :].reshape(T, Hkv, hd).astype(np.float16))
    clear_ring_tokens(plan, st, 1, range(pos, pos + T))
    assert np.isnan(st[0]).all() and np.isnan(st[1]).all()


def test_rowwise_kernels():
    rng = np.random.default_rng(7)
    T, D, F = 5, 64, 96
    x = rng.standard_normal((T, D)).astype(np.float32) * 4
    g = rng.standard_normal(D).astype(np.float32)
    _, f = build_request(KernelRequest(OpKind.RMSNORM, None, (TensorType(("T", D)),), (None,), (TensorType(("T", D)),), attrs=(("eps", 1e-5),)))
    out = run(build(f), x, g, np.zeros_like(x))[-1].numpy()
    x64 = x.astype(np.float64)
    assert np.abs(out - x64 / np.sqrt((x64**2).mean(1, keepdims=True) + 1e-5) * g).max() < 1e-5

    gu = rng.standard_normal((T, 2 * F)).astype(np.float32) * 5
    req = KernelRequest(OpKind.SILU_MUL, None, (TensorType(("T", 2 * F)),) * 2, ((0, F), (F, 2 * F)), (TensorType(("T", F)),))
    _, f = build_request(req)
    out = run(build(f), gu, gu, np.zeros((T, F), np.float32))[-1].numpy()
    a, b = gu[:, :F].astype(np.float64), gu[:, F:].astype(np.float64)
    assert np.abs(out - a / (1 + np.exp(-a)) * b).max() < 1e-5 * np.abs(a * b).max()

    y = rng.standard_normal((T, D)).astype(np.float32)
    _, f = build_request(KernelRequest(OpKind.ADD, None, (TensorType(("T", D)),) * 2, (None, None), (TensorType(("T", D)),)))
    np.testing.assert_array_equal(run(build(f), x, y, np.zeros_like(x))[-1].numpy(), x + y)


@pytest.mark.parametrize("qtype", [QuantType.Q8_0, QuantType.Q4_K, QuantType.F16])
def test_embedding(qtype):
    vocab, D = 40, 256
    comps, W = _weights(qtype, vocab, D, seed=8)
    fmt = FORMATS[qtype]
    toks = np.array([3, 0, 39, 3, 17], np.int32)
    req = KernelRequest(OpKind.EMBEDDING, None, (TensorType(("T",), "int32"),), (None,), (TensorType(("T", D)),), qtype, (vocab, D))
    _, f = build_request(req)
    out = run(build(f), toks, *[comps[c.name] for c in fmt.components], np.zeros((5, D), np.float32))[-1].numpy()
    np.testing.assert_array_equal(out, W[toks].astype(np.float32))


def test_exp_f32_accuracy():
    import tvm
    from tvm import te

    from ellm.schedules.vecmath import exp_f32

    n = 1 << 14
    X = te.placeholder((n,), "float32", name="x")
    Y = te.compute((n,), lambda i: exp_f32(X[i]), name="y")
    sch = tvm.s_tir.Schedule(te.create_prim_func([X, Y]))
    (i,) = sch.get_loops(sch.get_sblock("y"))
    sch.vectorize(sch.split(i, [None, 16])[1])
    x = np.linspace(-87, 88, n, dtype=np.float32)
    y = run(build(sch.mod), x, np.zeros(n, np.float32))[-1].numpy()
    ref = np.exp(x.astype(np.float64))
    assert (np.abs(y - ref) / ref).max() < 3 * 2.0**-24
    z = run(build(sch.mod), np.full(n, -200, np.float32), np.ones(n, np.float32))[-1].numpy()
    assert (z == 0).all()
