"""The block KV cache: plan arithmetic, ageing into each precision's store, and attention over the tiers,
against the NumPy model in tests/kvcache.py."""

from __future__ import annotations

import numpy as np
import pytest

from ellm.compiler.graph import OpKind, TensorType
from ellm.errors import EllmError
from ellm.kv.plan import KVPlan, KVType
from ellm.schedules import KernelRequest
from kernels import ISA_PRESETS, PRESET, build, build_request, isa_params, needs
from kvcache import (attend_ref, cache_attrs, empty_state, layer_args, quantise_ref, rotated_keys, sparse_ref,
                     stored_block)

from ellm.kv.attention import AttentionConfig
from ellm.schedules.attention import default_int_bits
from ellm.targets import IsaClass



def _order_tol() -> float:
    """Prefill against decode on the host: the same blocks and arithmetic, only the summation order differs
    (split-K partials, then a merge). With 8-bit value weights that order can tip a weight at a rounding tie
    by one step (1/127 of its block's largest weight): a few 1e-4 on the test data; float32 noise with 16 bits."""
    return 5e-4 if int_bits() == 8 else 5e-5


def excess(got: np.ndarray, ref: tuple[np.ndarray, np.ndarray]) -> float:
    """How far `got` is from the NumPy model's output beyond the model's rounding slack (kvcache.attend_ref)."""
    want, slack = ref
    return float((np.abs(got - want) - slack).max())


def int_bits(preset=None) -> int:
    """What a target's attention kernels round the query and value weights to before their integer dot products
    (0: float scores and values, no integer path); the NumPy model rounds as they do."""
    preset = preset or PRESET
    return default_int_bits(preset) if preset.isa is not None else 0


ORDER_TOL = _order_tol()


# the integer attention of each dot-product class, where the host can run it (the host's own is PRESET)
INT_CLASSES = (IsaClass.AVX2, IsaClass.AVX_VNNI, IsaClass.AVX512_VNNI)
CLASSES = isa_params(*INT_CLASSES)


def _per_class(kt, vt, *more):
    return [pytest.param(kt, vt, ISA_PRESETS[c], *more, id=f"{kt.value}-{vt.value}-{c.name.lower()}",
                         marks=needs(ISA_PRESETS[c])) for c in INT_CLASSES]

F32, F16, Q8, Q4 = KVType.F32, KVType.F16, KVType.Q8, KVType.Q4


def test_plan_sizes_and_slots():
    p = KVPlan.uniform(30, 3, 64, Q4, Q4, max_chunk=256)
    assert p.ring == 2 + 4 + 1
    # q4: 32 code bytes + 4 param bytes per 64 values, for K (per channel) and V (per token)
    assert p.bytes_per_token() == pytest.approx(2 * 30 * 3 * 36)
    assert p.nbytes(32768) / (23040 * 32768) < 0.35
    mixed = KVPlan(3, 64, (Q8, Q4, Q8), (F16, F16, Q4))
    assert mixed.slot("k", 2) == (Q8, 1) and mixed.slot("k", 1) == (Q4, 0) and mixed.slot("v", 2) == (Q4, 0)
    assert [s.name for s in mixed.state_tensors()] == [
        "ring_k", "ring_v", "k_q8", "k_q8_params", "k_q4", "k_q4_params", "v_f16", "v_q4", "v_q4_params"]
    assert KVPlan.from_key(mixed.key()) == mixed
    with pytest.raises(EllmError, match="f32"):
        KVPlan(3, 64, (F32, F16), (F32, F32))
    with pytest.raises(EllmError, match="block"):
        KVPlan(3, 64, (Q8,), (Q8,), block=48)


def test_pinned_blocks_and_rotation_in_the_plan():
    p = KVPlan.uniform(30, 3, 64, Q4, Q4, max_chunk=256, pinned=1, rotate_k=True)
    assert p.ring == 1 + 2 + 4 + 1
    # block 0 keeps slot 0; the others cycle through the remaining 7 (the ring holds as many as unpinned)
    assert [p.ring_slot(b) for b in (0, 1, 7, 8, 15)] == [0, 1, 7, 1, 1]
    assert p.rotated(0) and not KVPlan(3, 64, (F16, Q8, F16), (Q4,) * 3, pinned=1, ring=8, rotate_k=True).rotated(0)
    assert KVPlan.from_key(p.key()) == p
    old = p.to_dict()
    del old["pinned"], old["rotate_k"]  # a manifest from before either existed
    assert KVPlan.from_dict(old) == KVPlan(3, 64, p.k, p.v, 64, 2, p.ring)
    # a decode step at 8K reads the pinned block at float16 (K and V, 64 tokens, 3 heads of 64, 30 layers)
    plain = KVPlan.uniform(30, 3, 64, Q4, Q4, max_chunk=256)
    att = AttentionConfig()
    q4_block = 30 * 3 * 64 * 2 * 36  # codes + params of one block, K and V
    f16_block = 30 * 3 * 64 * 64 * 2 * 2
    assert p.read_bytes(8192, att) - plain.read_bytes(8192, att) == f16_block - q4_block
    with pytest.raises(EllmError, match="pinned"):
        KVPlan(3, 64, (Q8,), (Q8,), ring=3, pinned=1)


def test_truncation_keeps_pinned_blocks():
    """A cache truncated to n tokens is reusable while the ring still holds what a query at n reads from it:
    the pinned block always; the recent ones only if not yet overwritten."""
    from ellm.runtime.state import _Cache

    c = _Cache(hi_block=20)
    assert c.restorable(64 * 20 + 5, 64, 2, ring=8, pinned=1)
    assert not c.restorable(64 * 10, 64, 2, ring=8, pinned=1)  # block 9 was overwritten by block 16
    assert c.restorable(30, 64, 2, ring=8, pinned=1)  # block 0 only: pinned
    assert not c.restorable(30, 64, 2, ring=7, pinned=0)
    assert not c.restorable(64 + 30, 64, 2, ring=8, pinned=1)  # block 1 is gone (blocks 14 .. 20 cycle)


@pytest.mark.parametrize("t", [Q8, Q4])
def test_quantiser_error_bound(t):
    """Round-to-nearest with float16 (min, scale): error at most half a step (plus float16 rounding of the min)."""
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((200, 64)) * rng.uniform(0.1, 10, (200, 1))).astype(np.float32)
    deq, mn, sc = quantise_ref(x, t)
    bound = sc[:, None] / 2 * (1 + 2**-9) + np.abs(x) * 2**-10 + 1e-7
    assert (np.abs(deq - x) <= bound).all()
    assert (deq >= mn[:, None]).all() and (deq <= (mn + t.qmax * sc)[:, None] + 1e-6).all()


def _requests(plan: KVPlan, H: int, layer: int):
    Hkv, hd = plan.n_kv_heads, plan.head_dim
    cache_t = TensorType((plan.n_layers, Hkv, "C", hd), "float16")
    a = cache_attrs(plan, layer)
    append = KernelRequest(OpKind.KV_APPEND, None, (cache_t, TensorType(("T", Hkv * hd)), TensorType(("T", Hkv * hd))),
                           (None, None, None), (cache_t,), attrs=a)
    att = [KernelRequest(OpKind.ATTENTION, m, (TensorType(("T", H * hd)), cache_t), (None, None), (TensorType(("T", H * hd)),),
                         attrs=tuple(sorted((*a, ("n_heads", H))))) for m in (None, 1)]
    return append, att


def _kernels(append_req, pre_req, dec_req, chunk, preset=None):
    f_app = build(build_request(append_req, preset=preset)[1], preset)["kv_append"]
    f_pre = build(build_request(pre_req, preset=preset)[1], preset)["attention"] if pre_req is not None else None
    f_dec = build(build_request(dec_req, {"chunk_blocks": chunk // 64}, preset=preset)[1], preset)["attention"]
    return f_app, f_pre, f_dec


# every class on mixed q8 keys / q4 values (test_long_context_decode runs q4 keys / q8 values per class);
# uniform caches on the host's best target
@pytest.mark.parametrize("kt,vt,preset,protected", [(F16, F16, None, False), (F32, F32, None, False), (Q8, Q8, None, False),
                                                   (Q4, Q4, None, False), *_per_class(Q8, Q4, False),
                                                   (Q4, Q4, None, True), (F16, Q8, None, True)])
def test_append_age_and_attend(kt, vt, preset, protected):
    """Steps of uneven sizes append K/V; completed blocks age into the store; prefill and split-K decode
    attention read each block at the precision the tiers give it, as the NumPy model does (quantised
    blocks: with each dot-product class's integer scores and values). `protected`: the first block pinned in
    the ring, and quantised keys stored (and scored) in each head's Hadamard basis."""
    import tvm

    H, Hkv, hd, layer = 6, 2, 64, 1
    plan = KVPlan.uniform(2, Hkv, hd, kt, vt, max_chunk=100, block=64, recent=2, pinned=int(protected),
                          rotate_k=protected)
    append_req, (pre_req, dec_req) = _requests(plan, H, layer)
    f_app, f_pre, f_dec = _kernels(append_req, pre_req, dec_req, 128, preset)
    rng = np.random.default_rng([ord(c) for c in kt.value + vt.value])  # hash() of enums changes per process
    ctx = 600
    k_all = (rng.standard_normal((Hkv, ctx, hd)) * 2).astype(np.float32)
    if plan.rotated(layer):  # keys whose rotation is exact (multiples of 1/8 in the Hadamard basis), so the
        k_all = rotated_keys(plan, layer, np.round(k_all * 8) / 8)  # stores can be compared code for code
    v_all = rng.standard_normal((Hkv, ctx, hd)).astype(np.float32)
    state = [tvm.runtime.tensor(a) for a in empty_state(plan, ctx)]
    args = layer_args(plan, layer, state)
    kslot, vslot = plan.slot("k", layer)[1], plan.slot("v", layer)[1]
    pos, worst = 0, 0.0
    for n in (37, 64, 1, 100, 90, 1, 1, 70, 100, 63, 1):
        kk = k_all[:, pos : pos + n].transpose(1, 0, 2).reshape(n, -1)
        vv = v_all[:, pos : pos + n].transpose(1, 0, 2).reshape(n, -1)
        f_app(*args, tvm.runtime.tensor(kk), tvm.runtime.tensor(vv), pos, layer, kslot, vslot)
        q = rng.standard_normal((n, H * hd)).astype(np.float32)
        out = tvm.runtime.tensor(np.zeros((n, H * hd), np.float32))
        (f_dec if n == 1 else f_pre)(tvm.runtime.tensor(q), *args, tvm.runtime.tensor(AttentionConfig.dense().as_array(plan.n_layers)), pos, layer, kslot, vslot, out)
        k_ref, q_ref = rotated_keys(plan, layer, k_all), rotated_keys(plan, layer, q.reshape(n, H, hd)).reshape(n, -1)
        for i in range(n):
            worst = max(worst, excess(out.numpy()[i], attend_ref(plan, layer, k_ref, v_all, q_ref[i], pos + i, H,
                                                                 int_bits(preset))))
        pos += n
    assert worst < 2e-4, worst
    # every completed block sits in the store exactly as the model quantises it
    by_name = {s.name: t.numpy() for s, t in zip(plan.state_tensors(), state)}
    rd = np.float32 if kt is F32 else np.float16
    for b in range(pos // plan.block):
        for h in range(Hkv):
            k, v = stored_block(plan, layer, by_name, h, b)
            blk = slice(b * 64, (b + 1) * 64)
            kr = k_ref[h, blk].astype(rd).astype(np.float32)
            vr = v_all[h, blk].astype(rd).astype(np.float32)
            k_want = kr if kt.is_float else quantise_ref(kr.T, kt)[0].T
            v_want = vr if vt.is_float else quantise_ref(vr, vt)[0]
            np.testing.assert_allclose(k, k_want, atol=1e-6)
            np.testing.assert_allclose(v, v_want, atol=1e-6)


@pytest.mark.parametrize("preset", CLASSES)
@pytest.mark.parametrize("kt,vt,chunk", [(Q8, Q4, 512), (Q4, Q8, 128)])
def test_long_context_decode(kt, vt, chunk, preset):
    """Split-K decode at 4,090 tokens (many chunks, a partial last block) over quantised blocks."""
    assert FilledCache(kt, vt, preset, ctx=4090).excess({"chunk_blocks": chunk // 64}) < 2e-4


class FilledCache:
    """A KV state holding `ctx` appended tokens over quantised blocks, and the NumPy model's answer for one
    decode query at its end: decode kernels of any knobs are checked against it."""

    def __init__(self, kt, vt, preset=None, ctx=4090, H=9, Hkv=3, hd=64):
        import tvm

        self.preset, self.H, self.ctx, layer = preset, H, ctx, 0
        self.plan = plan = KVPlan.uniform(1, Hkv, hd, kt, vt, max_chunk=256, block=64, recent=2)
        append_req, (_, self.dec_req) = _requests(plan, H, layer)
        f_app = build(build_request(append_req, preset=preset)[1], preset)["kv_append"]
        rng = np.random.default_rng(7)
        k_all = (rng.standard_normal((Hkv, ctx, hd)) * 2).astype(np.float32)
        v_all = rng.standard_normal((Hkv, ctx, hd)).astype(np.float32)
        self.state = [tvm.runtime.tensor(a) for a in empty_state(plan, ctx)]
        self.args = layer_args(plan, layer, self.state)
        for pos in range(0, ctx, 256):
            n = min(256, ctx - pos)
            kk = np.ascontiguousarray(k_all[:, pos : pos + n].transpose(1, 0, 2).reshape(n, -1))
            vv = np.ascontiguousarray(v_all[:, pos : pos + n].transpose(1, 0, 2).reshape(n, -1))
            f_app(*self.args, tvm.runtime.tensor(kk), tvm.runtime.tensor(vv), pos, layer, 0, 0)
        self.q = rng.standard_normal((1, H * hd)).astype(np.float32)
        self.k_all, self.v_all, self.refs = k_all, v_all, {}

    def ref(self, score_bits: int, value_bits: int):
        """The NumPy model's answer with scores and values rounded as the kernel does (0: float), cached."""
        key = (score_bits, value_bits)
        if key not in self.refs:
            self.refs[key] = attend_ref(self.plan, 0, self.k_all, self.v_all, self.q[0], self.ctx - 1, self.H,
                                        score_bits, value_bits=value_bits)
        return self.refs[key]

    def excess(self, knobs) -> float:
        """How far decode with `knobs` lands from the model, beyond the model's rounding slack: the model
        rounds scores and values to the knobs' int_bits where int_scores / int_values take the integer path."""
        import tvm

        rule, f = build_request(self.dec_req, knobs, preset=self.preset)
        assert rule.name == "attention_decode"
        full = rule.resolve_knobs(self.dec_req, self.preset, knobs)  # the given knobs over the request's defaults
        bits = full.get("int_bits", 0)  # no integer path on this class: float scores and values
        ref = self.ref(bits * full.get("int_scores", 0), bits * full.get("int_values", 0))
        out = tvm.runtime.tensor(np.zeros((1, self.q.shape[1]), np.float32))
        build(f, self.preset)["attention"](tvm.runtime.tensor(self.q), *self.args, tvm.runtime.tensor(AttentionConfig.dense().as_array(1)),
                                           self.ctx - 1, 0, 0, 0, out)
        return excess(out.numpy()[0], ref)


def _filled(plan, layer, ctx, seed, step=100):
    """Kernels and a state holding ctx appended tokens (random K/V, with a few strong keys)."""
    import tvm

    H = 9
    Hkv, hd = plan.n_kv_heads, plan.head_dim
    append_req, (pre_req, dec_req) = _requests(plan, H, layer)
    f_app, f_pre, f_dec = _kernels(append_req, pre_req, dec_req, 128)
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((Hkv, ctx, hd)).astype(np.float32)
    k[:, rng.integers(0, ctx, 12)] *= 4  # a few keys that some query heads will want
    v = rng.standard_normal((Hkv, ctx, hd)).astype(np.float32)
    state = [tvm.runtime.tensor(a) for a in empty_state(plan, ctx)]
    args = layer_args(plan, layer, state)
    kslot, vslot = plan.slot("k", layer)[1], plan.slot("v", layer)[1]
    return H, k, v, state, args, (kslot, vslot), f_app, f_pre, f_dec, rng


def _append(f_app, args, k, v, pos, n, layer, slots):
    import tvm

    kk = np.ascontiguousarray(k[:, pos : pos + n].transpose(1, 0, 2).reshape(n, -1))
    vv = np.ascontiguousarray(v[:, pos : pos + n].transpose(1, 0, 2).reshape(n, -1))
    f_app(*args, tvm.runtime.tensor(kk), tvm.runtime.tensor(vv), pos, layer, *slots)


@pytest.mark.parametrize("kt,vt,n_layers", [(F16, F16, 1), (Q8, Q8, 1), (Q4, Q8, 1), (Q4, Q8, 2)])
def test_sparse_attention_reads_sinks_window_and_top_k(kt, vt, n_layers):
    """Without widening, decode and prefill read exactly sinks + window + the top-K blocks by bound; with a
    top-K per layer, the layer's own (here layer 1 reads top-3, layer 0 none)."""
    import tvm

    plan = KVPlan.uniform(n_layers, 3, 64, kt, vt, max_chunk=100)
    layer = n_layers - 1
    ctx, sinks, window, topk = 1400, 4, 200, 3
    H, k, v, state, args, slots, f_app, f_pre, f_dec, rng = _filled(plan, layer, ctx, 3)
    per_layer = (0,) * layer + (topk,) if n_layers > 1 else ()
    att = AttentionConfig(sinks=sinks, window=window, topk=topk if not per_layer else 50, widen=0, layer_topk=per_layer)
    cfg = tvm.runtime.tensor(att.as_array(n_layers))
    worst = 0.0
    for pos in range(0, ctx, 100):
        n = min(100, ctx - pos)
        _append(f_app, args, k, v, pos, n, layer, slots)
        q = rng.standard_normal((n, H * 64)).astype(np.float32)
        out = tvm.runtime.tensor(np.zeros((n, H * 64), np.float32))
        f_pre(tvm.runtime.tensor(q), *args, cfg, pos, layer, *slots, out)
        for i in range(0, n, 7):
            worst = max(worst, excess(out.numpy()[i], sparse_ref(plan, layer, k, v, q[i], pos + i, H, sinks, window, topk, int_bits())))
    q = rng.standard_normal((1, H * 64)).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros((1, H * 64), np.float32))
    f_dec(tvm.runtime.tensor(q), *args, cfg, ctx - 1, layer, *slots, out)
    worst = max(worst, excess(out.numpy()[0], sparse_ref(plan, layer, k, v, q[0], ctx - 1, H, sinks, window, topk, int_bits())))
    assert worst < 2e-4, worst


@pytest.mark.parametrize("margin", [0.0, 3.0])
def test_widening_reads_the_next_blocks_by_bound(margin):
    """Widening adds, in decreasing bound order, the unread blocks whose bound is within `margin` of the
    lowest best score of the KV head's query heads, at most `widen` of them: as the NumPy model does."""
    import tvm

    plan = KVPlan.uniform(1, 3, 64, Q8, Q8, max_chunk=100)
    ctx = 1400
    H, k, v, state, args, slots, f_app, f_pre, f_dec, rng = _filled(plan, 0, ctx, 6)
    for pos in range(0, ctx, 100):
        _append(f_app, args, k, v, pos, 100, 0, slots)
    cfg = AttentionConfig(window=200, topk=3, widen=4, margin=margin)
    arr = tvm.runtime.tensor(cfg.as_array(plan.n_layers))
    q = rng.standard_normal((4, H * 64)).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros((4, H * 64), np.float32))
    f_pre(tvm.runtime.tensor(q), *args, arr, ctx - 4, 0, *slots, out)
    one = tvm.runtime.tensor(np.zeros((1, H * 64), np.float32))
    f_dec(tvm.runtime.tensor(q[3:]), *args, arr, ctx - 1, 0, *slots, one)
    for i in range(4):
        want = sparse_ref(plan, 0, k, v, q[i], ctx - 4 + i, H, cfg.sinks, cfg.window, cfg.topk, int_bits(), cfg.widen, margin)
        assert excess(out.numpy()[i], want) < 2e-4
    assert np.abs(one.numpy()[0] - out.numpy()[3]).max() < ORDER_TOL


@pytest.mark.parametrize("kt,vt", [(F16, F16), (Q4, Q4)])
def test_widening_to_everything_equals_dense(kt, vt):
    """With enough widening and an infinite margin, sparse attention reads every block: it equals dense."""
    import tvm

    plan = KVPlan.uniform(1, 3, 64, kt, vt, max_chunk=100)
    ctx = 1000
    H, k, v, state, args, slots, f_app, f_pre, f_dec, rng = _filled(plan, 0, ctx, 4)
    for pos in range(0, ctx, 100):
        _append(f_app, args, k, v, pos, 100, 0, slots)
    wide = tvm.runtime.tensor(AttentionConfig(window=128, topk=2, widen=100, margin=1e30).as_array(plan.n_layers))
    dense = tvm.runtime.tensor(AttentionConfig.dense().as_array(plan.n_layers))
    q = rng.standard_normal((5, H * 64)).astype(np.float32)
    for f, n in ((f_dec, 1), (f_pre, 5)):
        a, b = (tvm.runtime.tensor(np.zeros((n, H * 64), np.float32)) for _ in range(2))
        f(tvm.runtime.tensor(q[:n]), *args, wide, ctx - n, 0, *slots, a)
        f(tvm.runtime.tensor(q[:n]), *args, dense, ctx - n, 0, *slots, b)
        assert np.abs(a.numpy() - b.numpy()).max() < 1e-5


def test_prefill_equals_decode_token_by_token():
    """The block-sparse prefill kernel gives each row what the decode kernel gives that token alone."""
    import tvm

    plan = KVPlan.uniform(1, 3, 64, Q8, Q4, max_chunk=100)
    ctx = 1300
    H, k, v, state, args, slots, f_app, f_pre, f_dec, rng = _filled(plan, 0, ctx, 5)
    for pos in range(0, ctx - 100, 100):
        _append(f_app, args, k, v, pos, 100, 0, slots)
    pos = ctx - 100
    _append(f_app, args, k, v, pos, 100, 0, slots)
    cfg = tvm.runtime.tensor(AttentionConfig(window=256, topk=4, widen=4, margin=2.0).as_array(plan.n_layers))
    q = rng.standard_normal((100, H * 64)).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros((100, H * 64), np.float32))
    f_pre(tvm.runtime.tensor(q), *args, cfg, pos, 0, *slots, out)
    one = tvm.runtime.tensor(np.zeros((1, H * 64), np.float32))
    for i in range(0, 100, 9):
        f_dec(tvm.runtime.tensor(q[i : i + 1]), *args, cfg, pos + i, 0, *slots, one)
        assert np.abs(one.numpy()[0] - out.numpy()[i]).max() < ORDER_TOL
