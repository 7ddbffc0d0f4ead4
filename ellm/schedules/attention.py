"""Causal GQA attention over the block KV cache (kv/plan.py), a block of B keys at a time.

Keys are stored transposed ([hd, 16] per tile), so the scores of 16 keys are one vector: sum over d of
q[d] * K[d, 16 keys], no horizontal sums. Quantised keys (per channel: min, scale) score as
sum_d q_d min_d + sum_d (q_d scale_d) code_d; quantised values (per token: min, scale) accumulate as
sum_j p_j min_j + sum_j (p_j scale_j) code_j. One task serves all G query heads of a KV head (each K and V
vector is loaded and converted once for G heads), with one online-softmax update per block. With VNNI,
both sums over codes run in int32 with vpdpbusd: the query times the key scales, and the weights
p_j scale_j, rounded to 16 bits per block (two int8 halves), against codes laid out 4 channels (keys) or
4 keys (values) per 32-bit lane. Single-token decode splits the blocks into chunks across threads
(split-K), prefetching the stored block ahead, and merges the partial softmax states. Query t of a step
sits at position pos + t and sees positions 0 .. pos + t; it reads block b from the float16 ring when
b > (pos + t) // B - recent, else from the store.
"""
from __future__ import annotations

import math
from typing import Mapping

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script.builder import ir as I

from ..compiler.graph import OpKind
from ..kv.plan import KVPlan, KVType
from ..targets import TargetPreset
from .kv_blocks import F32, L, KVBuffers, bc, f32, k_codes_f32, k_codes_group_u8, ramp, v_codes_f32, v_group_u8
from .rule import KernelRequest, Knob, Rule
from .sparse_select import NEG, block_bounds, collect_selected, top_k_threshold
from .vecmath import exp_f32, hmax, hsum
from .vnni import vpdpbusd

class _State:
    """Online-softmax state of one query head: small separate stack buffers, so LLVM keeps them in
    registers (TVM puts buffers over 1 KiB on the heap, where every update becomes a store)."""

    def __init__(self, hd: int, B: int):
        self.m = I.alloc_buffer((1,), "float32")  # running max
        self.l = I.alloc_buffer((1,), "float32")  # running sum
        self.acc = I.alloc_buffer((hd,), "float32")  # sum_j p_j v_j, less the quantised values' mins
        self.mv = I.alloc_buffer((L,), "float32")  # sum_j p_j min_j of quantised values, lanes summed at fold
        self.s = I.alloc_buffer((B,), "float32")  # scores of the current block
        self.p = I.alloc_buffer((B,), "float32")  # their probabilities (quantised V: times the value scales)
        self.whi = I.alloc_buffer((B,), "int8")  # quantised V, integer path: p * scale rounded to 16 bits,
        self.wlo = I.alloc_buffer((B,), "int8")  # in two int8 halves, times wf
        self.wf = I.alloc_buffer((1,), "float32")
        self.ihi = I.alloc_buffer((L,), "int32")  # their sums over the block for 16 channels
        self.ilo = I.alloc_buffer((L,), "int32")
        self.hd = hd
        I.buffer_store(self.m, f32(NEG), [0])
        I.buffer_store(self.l, f32(0.0), [0])
        I.buffer_store(self.mv, bc(f32(0.0)), [ramp(0)])
        for c in range(hd // L):
            I.buffer_store(self.acc, bc(f32(0.0)), [ramp(c * L)])

    def fold(self) -> None:
        """acc += the value mins' share (kept as one vector instead of hd/16 vector updates per key)."""
        total = I.Bind(hsum(self.mv[ramp(0)]))
        for c in range(self.hd // L):
            I.buffer_store(self.acc, self.acc[ramp(c * L)] + bc(total), [ramp(c * L)])
        I.buffer_store(self.mv, bc(f32(0.0)), [ramp(0)])


class _Query:
    """Query heads head0 .. head0+G-1 of token t, scaled by 1/sqrt(hd): qs[g * hd + d]; qk holds q times the
    key scales of the current block (quantised K) and kc[g] = sum_d q_d min_d."""

    def __init__(self, q, t, head0, G: int, hd: int, scale: float, int_scores: bool = False):
        self.G, self.hd = G, hd
        self.qs = I.alloc_buffer((G * hd,), "float32")
        self.qk = I.alloc_buffer((G * hd,), "float32")
        self.kc = I.alloc_buffer((G,), "float32")
        if int_scores:  # qk rounded to 16 bits per head and block, qk ~ qf[g] * (256 qhi + qlo), int8 halves
            self.qhi = I.alloc_buffer((G * hd,), "int8")
            self.qlo = I.alloc_buffer((G * hd,), "int8")
            self.qf = I.alloc_buffer((G,), "float32")
            self.shi = I.alloc_buffer((G * L,), "int32")  # integer scores of 16 keys: high and low halves
            self.slo = I.alloc_buffer((G * L,), "int32")
        for g in range(G):
            for c in range(hd // L):
                I.buffer_store(self.qs, q[t, ramp((head0 + g) * hd + c * L)] * bc(f32(scale)), [ramp(g * hd + c * L)])


def _attend_block(kv: KVBuffers, qy: _Query, layer, kslot, vslot, kvh, b, limit, ring: bool, states) -> None:
    """Online softmax over block b (keys b*B .. b*B+B-1, those < limit) from the ring or the store:
    the block's scores, one softmax update, then its values."""
    B, hd, G = kv.block, qy.hd, qy.G
    kt = KVType.F16 if ring else kv.kt
    vt = KVType.F16 if ring else kv.vt
    slot = kv.ring_slot(b)
    if not kt.is_float:  # per-block key scales and mins folded into the query
        for g in range(G):
            acc = bc(f32(0.0))
            for c in range(hd // L):
                mn = tirx.Cast(F32, kv.k_side[kslot, kvh, b, 0, ramp(c * L)])
                sc = tirx.Cast(F32, kv.k_side[kslot, kvh, b, 1, ramp(c * L)])
                qv = qy.qs[ramp(g * hd + c * L)]
                I.buffer_store(qy.qk, qv * sc, [ramp(g * hd + c * L)])
                acc = acc + qv * mn
            I.buffer_store(qy.kc, hsum(acc), [g])
    int_scores = kv.int_scores and not ring
    if int_scores:
        _quantise_query(qy)
    qk = qy.qs if kt.is_float else qy.qk

    def key_vec(d, sub):
        if ring:
            return tirx.Cast(F32, kv.ring_k[layer, kvh, slot, sub, d, ramp(0)])
        if kt.is_float:
            return tirx.Cast(F32, kv.k_store[kslot, kvh, b, sub, d, ramp(0)])
        return k_codes_f32(kv.k_store, (kslot, kvh, b, d), kt, sub)

    with I.serial(0, B // L) as sub:  # scores, 16 keys at a time (ring: stale keys past the limit masked below)
        if int_scores:  # sum_d q16_d code_d exactly in int32, 4 channels per vpdpbusd and half
            for g in range(G):
                for acc in (qy.shi, qy.slo):
                    I.buffer_store(acc, bc(tirx.const(0, "int32")), [ramp(g * L)])
            with I.serial(0, hd // 4) as w:
                codes = I.Bind(tirx.reinterpret("int8x64", k_codes_group_u8(kv.k_store, (kslot, kvh, b), kt, sub, w)))
                for g in range(G):
                    for acc, half in ((qy.shi, qy.qhi), (qy.slo, qy.qlo)):
                        word = tirx.reinterpret("int32", half[tirx.Ramp(g * hd + 4 * w, 1, 4)])
                        qb = tirx.reinterpret("int8x64", tirx.Broadcast(word, L))
                        I.buffer_store(acc, vpdpbusd(acc[ramp(g * L)], codes, qb), [ramp(g * L)])
            for g, st in enumerate(states):
                si = (qy.shi[ramp(g * L)] << bc(tirx.const(8, "int32"))) + qy.slo[ramp(g * L)]
                I.buffer_store(st.s, bc(qy.kc[g]) + bc(qy.qf[g]) * tirx.Cast(F32, si), [ramp(sub * L)])
        else:
            for g, st in enumerate(states):
                I.buffer_store(st.s, bc(qy.kc[g]) if not kt.is_float else bc(f32(0.0)), [ramp(sub * L)])
            with I.serial(0, hd) as d:
                kvec = I.Bind(key_vec(d, sub))
                for g, st in enumerate(states):
                    I.buffer_store(st.s, st.s[ramp(sub * L)] + bc(qk[g * hd + d]) * kvec, [ramp(sub * L)])
    for st in states:  # one online-softmax update for the block
        mx = I.alloc_buffer((L,), "float32")
        tot = I.alloc_buffer((L,), "float32")
        I.buffer_store(mx, bc(f32(NEG)), [ramp(0)])
        I.buffer_store(tot, bc(f32(0.0)), [ramp(0)])
        with I.serial(0, B // L) as sub:
            if ring:
                I.buffer_store(st.s, tirx.Select(ramp(b * B + sub * L) < bc(limit), st.s[ramp(sub * L)], bc(f32(NEG))),
                               [ramp(sub * L)])
            I.buffer_store(mx, tirx.max(mx[ramp(0)], st.s[ramp(sub * L)]), [ramp(0)])
        m_old = st.m[0]
        m_new = I.Bind(tirx.max(m_old, hmax(mx[ramp(0)])))
        corr = I.Bind(exp_f32(m_old - m_new))
        with I.serial(0, B // L) as sub:
            pv = I.Bind(exp_f32(st.s[ramp(sub * L)] - bc(m_new)))
            I.buffer_store(st.p, pv, [ramp(sub * L)])
            I.buffer_store(tot, tot[ramp(0)] + pv, [ramp(0)])
        I.buffer_store(st.l, st.l[0] * corr + hsum(tot[ramp(0)]), [0])
        I.buffer_store(st.m, m_new, [0])
        if not kv.vt.is_float:  # also in ring blocks: mv may hold store blocks' share
            I.buffer_store(st.mv, st.mv[ramp(0)] * bc(corr), [ramp(0)])
        for c in range(hd // L):
            I.buffer_store(st.acc, st.acc[ramp(c * L)] * bc(corr), [ramp(c * L)])
    if ring or vt.is_float:
        _float_values(kv, layer, vslot, kvh, b, slot, limit, ring, states)
    else:
        _quantised_values(kv, vslot, kvh, b, states)


def _float_values(kv: KVBuffers, layer, vslot, kvh, b, slot, limit, ring: bool, states) -> None:
    """acc += p_j v_j over the block's float rows: only rows that exist (beyond the limit the ring holds
    stale or uninitialised values)."""
    B, hd = kv.block, kv.plan.head_dim
    with I.serial(0, tirx.min(tirx.IntImm("int64", B), limit - b * B) if ring else B) as j:
        if ring:
            rows = [I.Bind(tirx.Cast(F32, kv.ring_v[layer, kvh, slot, j, ramp(c * L)])) for c in range(hd // L)]
        else:
            rows = [I.Bind(tirx.Cast(F32, kv.v_store[vslot, kvh, b, j, ramp(c * L)])) for c in range(hd // L)]
        for st in states:
            w = bc(st.p[j])
            for c in range(hd // L):
                I.buffer_store(st.acc, st.acc[ramp(c * L)] + w * rows[c], [ramp(c * L)])


def _quantised_values(kv: KVBuffers, vslot, kvh, b, states) -> None:
    """acc += p_j (min_j + scale_j code_j) over a stored block (always complete): the mins' share as one
    vector, the codes' with weights w_j = p_j scale_j. Integer path: w rounded to 16 bits per head and
    block (wf = max w / Q16, two int8 halves) and summed over 4 keys per vpdpbusd, as the scores are."""
    B, hd, vt = kv.block, kv.plan.head_dim, kv.vt
    idx = (vslot, kvh, b)
    for st in states:
        with I.serial(0, B // L) as sub:  # p -> w = p * scale in place
            p = st.p[ramp(sub * L)]
            mn = tirx.Cast(F32, kv.v_params[vslot, kvh, b, 0, ramp(sub * L)])
            sc = tirx.Cast(F32, kv.v_params[vslot, kvh, b, 1, ramp(sub * L)])
            I.buffer_store(st.mv, st.mv[ramp(0)] + p * mn, [ramp(0)])
            I.buffer_store(st.p, p * sc, [ramp(sub * L)])
        if kv.int_values:
            _split16([st.p[ramp(sub * L)] for sub in range(B // L)], st.whi, st.wlo, st.wf)
    if not kv.int_values:
        with I.serial(0, B // 4) as g:
            groups = [I.Bind(v_group_u8(kv.v_store, idx, vt, c, g)) for c in range(hd // L)]
            for k in range(4):
                rows = [I.Bind(v_codes_f32(grp, k)) for grp in groups]
                for st in states:
                    w = bc(st.p[g * 4 + k])
                    for c in range(hd // L):
                        I.buffer_store(st.acc, st.acc[ramp(c * L)] + w * rows[c], [ramp(c * L)])
        return
    per = 1 if vt is KVType.Q8 else 2  # key groups per 64-byte load
    zero = bc(tirx.const(0, "int32"))
    with I.serial(0, hd // L, unroll=False) as c:  # unrolled, it only multiplies compile time
        for st in states:
            I.buffer_store(st.ihi, zero, [ramp(0)])
            I.buffer_store(st.ilo, zero, [ramp(0)])
        with I.serial(0, B // 4 // per) as m:
            raw = I.Bind(kv.v_store[vslot, kvh, b, c, m, tirx.Ramp(0, 1, 64)])
            nib = tirx.Broadcast(tirx.const(15, "uint8"), 64)
            halves = [raw] if per == 1 else [raw & nib, raw >> tirx.Broadcast(tirx.const(4, "uint8"), 64)]
            for h, codes in enumerate(halves):
                g = m * per + h
                codes = I.Bind(tirx.reinterpret("int8x64", codes))
                for st in states:
                    for acc, half in ((st.ihi, st.whi), (st.ilo, st.wlo)):
                        word = tirx.reinterpret("int32", half[tirx.Ramp(4 * g, 1, 4)])
                        wb = tirx.reinterpret("int8x64", tirx.Broadcast(word, L))
                        I.buffer_store(acc, vpdpbusd(acc[ramp(0)], codes, wb), [ramp(0)])
        for st in states:
            whole = tirx.Cast(F32, st.ihi[ramp(0)]) * bc(f32(256.0)) + tirx.Cast(F32, st.ilo[ramp(0)])
            I.buffer_store(st.acc, st.acc[ramp(c * L)] + whole * bc(st.wf[0]), [ramp(c * L)])


Q16 = 127 * 256  # |q16| <= Q16 keeps both int8 halves in [-128, 127] and every sum inside int32


def _split16(vecs, hi_buf, lo_buf, scale_buf, at=0, base=0) -> None:
    """v16 = round(v / f) with f = max |v| / Q16 over the float32x16 vectors `vecs`, split v16 = 256 hi + lo
    into int8 halves hi_buf/lo_buf[base + 16i ..]; scale_buf[at] = f."""
    i32 = f"int32x{L}"
    mx = tirx.abs(vecs[0])
    for v in vecs[1:]:
        mx = tirx.max(mx, tirx.abs(v))
    amax = I.Bind(hmax(mx))
    inv = I.Bind(tirx.Select(amax > f32(0.0), f32(float(Q16)) / amax, f32(0.0)))
    I.buffer_store(scale_buf, amax / f32(float(Q16)), [at])
    for c, v in enumerate(vecs):
        v16 = I.Bind(tirx.Cast(i32, tirx.floor(v * bc(inv) + bc(f32(0.5)))))
        i32c = lambda v: bc(tirx.const(v, "int32"))  # noqa: E731
        lo = I.Bind(((v16 + i32c(128)) & i32c(255)) - i32c(128))
        hi = (v16 - lo) >> bc(tirx.const(8, "int32"))
        I.buffer_store(lo_buf, tirx.Cast(f"int8x{L}", lo), [ramp(base + c * L)])
        I.buffer_store(hi_buf, tirx.Cast(f"int8x{L}", hi), [ramp(base + c * L)])


def _quantise_query(qy: _Query) -> None:
    """qk rounded to 16 bits per head (two int8 halves, as the integer matmuls split 16-bit activations):
    the scores keep float32-like precision."""
    for g in range(qy.G):
        vecs = [qy.qk[ramp(g * qy.hd + c * L)] for c in range(qy.hd // L)]
        _split16(vecs, qy.qhi, qy.qlo, qy.qf, g, g * qy.hd)


def _attend(kv, qy, layer, kslot, vslot, kvh, b, limit, first_ring, states) -> None:
    """Block b for a query whose ring-precision blocks start at first_ring."""
    with I.If(b >= first_ring):
        with I.Then():
            _attend_block(kv, qy, layer, kslot, vslot, kvh, b, limit, True, states)
        with I.Else():
            _attend_block(kv, qy, layer, kslot, vslot, kvh, b, limit, False, states)


def _finish(out, t, kvh, G: int, hd: int, states) -> None:
    for g, st in enumerate(states):
        st.fold()
        inv = I.Bind(f32(1.0) / st.l[0])
        for c in range(hd // L):
            I.buffer_store(out, st.acc[ramp(c * L)] * bc(inv), [t, ramp((kvh * G + g) * hd + c * L)])


def kv_plan_of(req: KernelRequest) -> tuple[KVPlan, KVType, KVType]:
    """The request's KV plan and this layer's K and V types (attrs set by lowering)."""
    plan = KVPlan.from_key(req.attr("kv_plan"))
    return plan, KVType(req.attr("kv_k")), KVType(req.attr("kv_v"))


class _Shape:
    """Which blocks a query at position n_ctx - 1 reads, from the run-time config
    attn = [sinks, window, topk, widen, margin] (topk < 0: dense). Items of its read list: the sink blocks
    [0, sb) (the first `sinks` tokens rounded up to whole blocks), the selected blocks of the candidates
    [sb, wb), the window blocks [wb, cur]. Dense, or too few candidates to choose from: sb = 0, wb = 0."""

    def __init__(self, kv: KVBuffers, attn, n_ctx):
        B = kv.block
        i64 = lambda x: I.Bind(tirx.Cast("int64", x))  # noqa: E731
        zero = tirx.IntImm("int64", 0)
        self.n_ctx = n_ctx
        self.topk, self.widen = i64(attn[2]), i64(attn[3])
        self.margin = attn[4]
        window = I.Bind(tirx.max(i64(attn[1]), tirx.IntImm("int64", kv.plan.recent * B)))
        self.cur = I.Bind((n_ctx - 1) // B)  # the query's own block
        self.first_ring = self.cur - (kv.plan.recent - 1)
        wb = I.Bind(tirx.max(n_ctx - window, zero) // B)  # the window's first block
        sb = I.Bind(tirx.min((i64(attn[0]) + B - 1) // B, wb))
        self.dense = I.Bind(_opaque(tirx.Select(tirx.any(self.topk < 0, wb - sb <= self.topk), 1, 0), "int32"))
        self.sb = I.Bind(_opaque(tirx.Select(self.dense == 1, zero, sb)))
        self.wb = I.Bind(_opaque(tirx.Select(self.dense == 1, zero, wb)))
        self.n_cand = I.Bind(self.wb - self.sb)


def _selection(kv, qy, G, kvh, kslot, sh: _Shape, bounds, bbase, sel, sbase, count):
    """Bounds of the candidate blocks, the top-K threshold, and sel[sbase : sbase + count] in index order."""
    block_bounds(kv, qy.qs, G, kvh, kslot, sh.sb, sh.n_cand, bounds, bbase)
    thr = I.alloc_buffer((1,), "float32")
    with I.If(sh.topk > 0):
        with I.Then():
            I.buffer_store(thr, top_k_threshold(bounds, bbase, sh.n_cand, sh.topk), [0])
        with I.Else():
            I.buffer_store(thr, f32(-NEG), [0])
    collect_selected(bounds, bbase, sh.sb, sh.n_cand, thr[0], sh.topk, sel, sbase, count)
    return thr


def _widen(kv, qy: _Query, layer, kslot, vslot, kvh, sh: _Shape, bounds, bbase, thr, last_sel, states, sel, sbase,
           count) -> None:
    """Dynamic widening for the G query heads of KV head kvh (they share blocks, as the selection does):
    while the best unread block's bound (the largest over the G heads) is within `margin` of the lowest of
    the heads' best scores read so far, read it too for all G heads (at most `widen` blocks), in decreasing
    bound order. The unread blocks that can be reached are the `widen` next ones by bound: found once (a
    second bisection), listed after the selection in sel[sbase + count :] and sorted by decreasing bound
    (ties in block order), so each step takes the next and prefetches the one after it."""
    thr2 = I.alloc_buffer((1,), "float32")
    nw = I.alloc_buffer((1,), "int64")
    I.buffer_store(nw, tirx.IntImm("int64", 0), [0])
    at = sbase + count  # the list: sel[at : at + nw]
    with I.If(sh.widen > 0):
        with I.Then():
            k2 = I.Bind(tirx.min(sh.topk + sh.widen, sh.n_cand))
            with I.If(k2 < sh.n_cand):
                with I.Then():
                    I.buffer_store(thr2, top_k_threshold(bounds, bbase, sh.n_cand, k2), [0])
                with I.Else():
                    I.buffer_store(thr2, f32(NEG), [0])
            with I.serial(0, sh.n_cand) as i:
                u = bounds[bbase + i]
                selected = tirx.all(u >= thr[0], tirx.Cast("int64", last_sel) >= sh.sb + i)
                with I.If(tirx.all(tirx.Not(selected), u >= thr2[0])):
                    with I.Then():
                        I.buffer_store(sel, tirx.Cast("int32", i), [at + nw[0]])
                        I.buffer_store(nw, nw[0] + 1, [0])
            _sort_by_bound(sel, at, nw[0], bounds, bbase)
            with I.If(nw[0] > 0):
                with I.Then():
                    kv.prefetch_block(kslot, vslot, kvh, sh.sb + tirx.Cast("int64", sel[at]))
    go = I.alloc_buffer((1,), "int32")
    I.buffer_store(go, tirx.const(1, "int32"), [0])
    with I.serial(0, tirx.min(sh.widen, nw[0])) as j:
        with I.If(go[0] == 1):
            with I.Then():
                m_low = states[0].m[0]
                for st in states[1:]:
                    m_low = tirx.min(m_low, st.m[0])
                i = I.Bind(tirx.Cast("int64", sel[at + j]))
                with I.If(bounds[bbase + i] > m_low - sh.margin):
                    with I.Then():
                        with I.If(j + 1 < nw[0]):
                            with I.Then():
                                kv.prefetch_block(kslot, vslot, kvh, sh.sb + tirx.Cast("int64", sel[at + j + 1]))
                        _attend_block(kv, qy, layer, kslot, vslot, kvh, sh.sb + i, sh.n_ctx, False, states)
                    with I.Else():
                        I.buffer_store(go, tirx.const(0, "int32"), [0])


def _sort_by_bound(sel, at, n, bounds, bbase) -> None:
    """Insertion sort of the candidate indices sel[at : at + n] by decreasing bound, stable (n is small)."""
    with I.serial(1, n) as a:
        key = I.Bind(sel[at + a])
        kb = I.Bind(bounds[bbase + tirx.Cast("int64", key)])
        pos = I.alloc_buffer((1,), "int64")
        I.buffer_store(pos, a, [0])
        with I.While(tirx.all(pos[0] > 0, bounds[bbase + tirx.Cast("int64", sel[at + tirx.max(pos[0] - 1, 0)])] < kb)):
            I.buffer_store(sel, sel[at + pos[0] - 1], [at + pos[0]])
            I.buffer_store(pos, pos[0] - 1, [0])
        I.buffer_store(sel, key, [at + pos[0]])


def int_scores_for(target: TargetPreset) -> bool:
    """Integer scores for quantised keys need vpdpbusd (VNNI) and vpermb (VBMI)."""
    return target.vnni and "avx512vbmi" in target.llvm_features


def build_attention(req: KernelRequest, chunk: int, int_scores: bool = False, int_values: bool = False,
                    prefetch: int = 0):
    """`chunk` > 0 splits the keys of single-token steps into chunks of that many keys (whole blocks).
    `int_scores`: quantised key blocks are scored with vpdpbusd against the query rounded to 16 bits;
    `int_values`: quantised value blocks are summed with vpdpbusd, the weights rounded to 16 bits;
    `prefetch` > 0: decode prefetches the stored block that many items ahead in its read list."""
    plan, kt, vt = kv_plan_of(req)
    hd, Hkv = plan.head_dim, plan.n_kv_heads
    H = int(req.attr("n_heads"))
    G = H // Hkv
    scale = 1.0 / math.sqrt(hd)
    with IRBuilder() as ib:
        with I.prim_func():
            I.func_name("attention")
            I.func_attr({"tirx.noalias": True})
            n = req.m if req.m is not None else tirx.Var("T", "int64")
            q = I.arg("q", I.buffer((n, H * hd), "float32"))  # [T, n_heads * head_dim], rotated
            kv = KVBuffers.declare(plan, kt, vt, int_scores, int_values)
            attn = I.arg("attn", I.buffer((5,), "float32"))  # [sinks, window, topk, widen, margin]
            pos, layer, kslot, vslot = KVBuffers.step_args()
            out = I.arg("out", I.buffer((n, H * hd), "float32"))
            ctx = (q, kv, attn, pos, layer, kslot, vslot, out, Hkv, G, hd, scale)
            if req.m == 1 and chunk:
                _decode(*ctx, max(1, chunk // plan.block), prefetch)
            else:
                _prefill(*ctx, n)
    return ib.get()


def _item(sh: _Shape, i, count, sel_at):
    """Block of item i of a query's read list (see _Shape), computed with statements into a small buffer:
    nested selects in buffer indices make TVM's region analysis explode."""
    bl = I.alloc_buffer((1,), "int64")
    with I.If(i < sh.sb):
        with I.Then():
            I.buffer_store(bl, i, [0])
        with I.Else():
            with I.If(i < sh.sb + count):
                with I.Then():
                    I.buffer_store(bl, tirx.Cast("int64", sel_at(i - sh.sb)), [0])
                with I.Else():
                    I.buffer_store(bl, sh.wb + i - sh.sb - count, [0])
    return bl[0]


def _opaque(value, dtype: str = "int64"):
    """`value` through a one-element buffer: later uses see a load, not the expression (TVM's buffer-region
    analysis substitutes let-bound expressions and slows to minutes on nested selects)."""
    buf = I.alloc_buffer((1,), dtype)
    I.buffer_store(buf, value, [0])
    return buf[0]


def _n_items(sh: _Shape, count):
    return sh.sb + count + sh.cur + 1 - sh.wb


def _prefill(q, kv, attn, pos, layer, kslot, vslot, out, Hkv: int, G: int, hd: int, scale: float, n) -> None:
    """Tasks = (query row, KV head), rows in zig-zag order (0, last, 1, last-1, ...) so each thread's
    contiguous share of tasks mixes short and long causal rows. Each row selects its own blocks exactly
    as a decode step at its position would."""
    NBp = kv.nb + L
    bounds = I.alloc_buffer((n * Hkv * NBp,), "float32")
    sel = I.alloc_buffer((n * Hkv * kv.nb,), "int32")
    with I.parallel(0, n * Hkv) as task:
        r = task // Hkv
        kvh = task % Hkv
        t = I.Bind(tirx.Select(r % 2 == 0, r // 2, n - 1 - r // 2))
        sh = _Shape(kv, attn, pos + t + 1)
        qy = _Query(q, t, kvh * G, G, hd, scale, kv.int_scores)
        states = [_State(hd, kv.block) for _ in range(G)]
        count = I.alloc_buffer((1,), "int32")
        thr = I.alloc_buffer((1,), "float32")
        I.buffer_store(count, tirx.const(0, "int32"), [0])
        sbase = task * kv.nb
        with I.If(sh.dense == 0):
            with I.Then():
                t_ = _selection(kv, qy, G, kvh, kslot, sh, bounds, task * NBp, sel, sbase, count)
                I.buffer_store(thr, t_[0], [0])
        cnt = I.Bind(tirx.Cast("int64", count[0]))
        with I.serial(0, I.Bind(_opaque(_n_items(sh, cnt)))) as i:
            b = I.Bind(_item(sh, i, cnt, lambda j: sel[sbase + j]))
            _attend(kv, qy, layer, kslot, vslot, kvh, b, sh.n_ctx, sh.first_ring, states)
        with I.If(sh.dense == 0):
            with I.Then():
                last = tirx.Select(cnt > 0, sel[sbase + tirx.max(cnt - 1, 0)], -1)
                _widen(kv, qy, layer, kslot, vslot, kvh, sh, bounds, task * NBp, thr, last, states, sel, sbase, cnt)
        _finish(out, t, kvh, G, hd, states)


def _decode(q, kv, attn, pos, layer, kslot, vslot, out, Hkv: int, G: int, hd: int, scale: float, bpc: int,
            prefetch: int) -> None:
    """One query token. Phase 1 (sparse only, one task per KV head): bounds, top-K and the block list.
    Phase 2: tasks = (KV head, run of bpc blocks of the list) write partial (max, sum, acc) (split-K).
    Phase 3, per KV head: merge the partials of its G query heads, widen if needed, normalise."""
    sh = _Shape(kv, attn, pos + 1)
    NBp = kv.nb + L
    bounds = I.alloc_buffer((Hkv * NBp,), "float32")
    sel = I.alloc_buffer((Hkv * kv.nb,), "int32")
    n_list = I.alloc_buffer((Hkv,), "int32")
    thrs = I.alloc_buffer((Hkv,), "float32")
    lasts = I.alloc_buffer((Hkv,), "int32")
    with I.If(sh.dense == 0):
        with I.Then():
            with I.parallel(0, Hkv) as kvh:
                qy = _Query(q, 0, kvh * G, G, hd, scale)
                count = I.alloc_buffer((1,), "int32")
                thr = _selection(kv, qy, G, kvh, kslot, sh, bounds, kvh * NBp, sel, kvh * kv.nb, count)
                I.buffer_store(thrs, thr[0], [kvh])
                I.buffer_store(lasts, tirx.Select(count[0] > 0, sel[kvh * kv.nb + tirx.max(count[0] - 1, 0)], -1), [kvh])
                I.buffer_store(n_list, count[0], [kvh])
    # items: dense, blocks 0 .. cur; sparse, per KV head: the sinks, the selected blocks, the window
    n_items = I.Bind(_n_items(sh, tirx.Select(sh.dense == 1, tirx.IntImm("int64", 0), sh.topk)))
    n_chunks = I.Bind((n_items + bpc - 1) // bpc)
    # sized from NB alone (the list never exceeds NB blocks): TVM's storage rewrite hoists allocations
    # to the top of the function, above any value computed at run time
    max_chunks = (kv.nb + bpc - 1) // bpc
    part_st = I.alloc_buffer((Hkv * max_chunks * G * 2,), "float32")
    part_acc = I.alloc_buffer((Hkv * max_chunks * G * hd,), "float32")
    with I.parallel(0, Hkv * n_chunks) as task:
        kvh = task // n_chunks
        c = task % n_chunks
        qy = _Query(q, 0, kvh * G, G, hd, scale, kv.int_scores)
        states = [_State(hd, kv.block) for _ in range(G)]
        cnt = I.Bind(_opaque(tirx.Select(sh.dense == 1, tirx.IntImm("int64", 0), tirx.Cast("int64", n_list[kvh]))))
        end = I.Bind(_opaque(_n_items(sh, cnt)))
        with I.serial(c * bpc, tirx.min(c * bpc + bpc, end)) as i:
            if prefetch:  # the list's block `prefetch` items ahead (past this task's chunk too: the same thread
                # usually takes the next chunk)
                with I.If(i + prefetch < end):
                    with I.Then():
                        ahead = I.Bind(_item(sh, i + prefetch, cnt, lambda j: sel[kvh * kv.nb + j]))
                        kv.prefetch_block(kslot, vslot, kvh, ahead)
            b = I.Bind(_item(sh, i, cnt, lambda j: sel[kvh * kv.nb + j]))
            _attend(kv, qy, layer, kslot, vslot, kvh, b, sh.n_ctx, sh.first_ring, states)
        for g, st in enumerate(states):
            st.fold()
            I.buffer_store(part_st, st.m[0], [(task * G + g) * 2])
            I.buffer_store(part_st, st.l[0], [(task * G + g) * 2 + 1])
            for cc in range(hd // L):
                I.buffer_store(part_acc, st.acc[ramp(cc * L)], [ramp((task * G + g) * hd + cc * L)])
    with I.parallel(0, Hkv) as kvh:
        states = [_State(hd, kv.block) for _ in range(G)]
        for g, st in enumerate(states):
            with I.serial(0, n_chunks) as c:
                I.buffer_store(st.m, tirx.max(st.m[0], part_st[((kvh * n_chunks + c) * G + g) * 2]), [0])
            with I.serial(0, n_chunks) as c:
                base = (kvh * n_chunks + c) * G + g
                w = I.Bind(exp_f32(part_st[base * 2] - st.m[0]))
                I.buffer_store(st.l, st.l[0] + part_st[base * 2 + 1] * w, [0])
                for cc in range(hd // L):
                    I.buffer_store(st.acc, st.acc[ramp(cc * L)] + part_acc[ramp(base * hd + cc * L)] * bc(w), [ramp(cc * L)])
        with I.If(sh.dense == 0):
            with I.Then():
                qy = _Query(q, 0, kvh * G, G, hd, scale, kv.int_scores)
                thr = I.alloc_buffer((1,), "float32")
                I.buffer_store(thr, thrs[kvh], [0])
                _widen(kv, qy, layer, kslot, vslot, kvh, sh, bounds, kvh * NBp, thr, lasts[kvh], states, sel, kvh * kv.nb,
                       tirx.Cast("int64", n_list[kvh]))
        _finish(out, 0, kvh, G, hd, states)


def _applies(req: KernelRequest) -> bool:
    return req.kind is OpKind.ATTENTION and req.in_cols[0] is None and req.attr("kv_plan") is not None


class AttentionDecodeRule(Rule):
    """One token: split-K over (KV head, key chunk) tasks, then a merge."""

    name = "attention_decode"
    knobs = (
        Knob("chunk", 256, (128, 256, 512, 1024, 2048), "keys per split-K task"),
        Knob("int_scores", 1, (0, 1), "score quantised key blocks with vpdpbusd (where the target has VNNI + VBMI)"),
        Knob("int_values", 1, (0, 1), "sum quantised value blocks with vpdpbusd (where the target has VNNI + VBMI)"),
        Knob("prefetch", 1, (0, 1, 2), "prefetch the stored block this many items ahead in the read list (0: off)"),
    )

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return req.m == 1 and _applies(req)

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        fast = int_scores_for(target)
        return build_attention(req, knobs["chunk"], bool(knobs["int_scores"]) and fast,
                               bool(knobs["int_values"]) and fast, knobs["prefetch"])


class AttentionPrefillRule(Rule):
    """A chunk of tokens: tasks over (query row, KV head), causal."""

    name = "attention"

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return req.m != 1 and _applies(req)

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        return build_attention(req, 0, int_scores_for(target), int_scores_for(target))
