"""One block of keys for the G query heads of a KV head: its scores, one online-softmax update, its values.

Scores: keys are stored transposed ([hd, 16] per tile), so 16 keys score as one vector. Quantised keys (per
channel: min, scale) score as sum_d q_d min_d + sum_d (q_d scale_d) code_d; on the integer path the second
sum runs exactly in int32 (schedules/intdot.py: vpdpbusd, or vpmaddubsw + vpmaddwd on AVX2) against the
query times the scales rounded to `kv.int_bits` bits (16: two int8 halves; 8: one, half the dot products).
Values: sum_j p_j v_j; quantised values (per token: min, scale) as sum_j p_j min_j + sum_j (p_j scale_j)
code_j, the mins' share one vector per head, and on the integer path the weights p_j scale_j rounded to
`kv.int_bits` bits per block and summed in int32 over 4 keys per 32-bit lane. Each K and V vector is
loaded and converted once for the G heads.
"""

from __future__ import annotations

from tvm import tirx
from tvm.tirx.script.builder import ir as I

from ..kv.plan import KVType
from ..targets import IsaClass
from .kv_blocks import (
    F32,
    KVBuffers,
    L,
    bc,
    f32,
    k_codes_f32,
    k_codes_group_u8,
    nibbles_u8x64,
    ramp,
    v_codes_f32,
    v_group_u8,
)
from .sparse_select import NEG
from .intdot import Dot, GroupSum
from .vecmath import exp_f32, hadamard, hmax, hsum


class State:
    """Online-softmax state of one query head: small separate stack buffers, so LLVM keeps them in
    registers (TVM puts buffers over 1 KiB on the heap, where every update becomes a store)."""

    def __init__(self, hd: int, B: int, int_bits: int = 16):
        self.m = I.alloc_buffer((1,), "float32")  # running max
        self.l = I.alloc_buffer((1,), "float32")  # running sum
        self.acc = I.alloc_buffer((hd,), "float32")  # sum_j p_j v_j, less the quantised values' mins
        self.mv = I.alloc_buffer((L,), "float32")  # sum_j p_j min_j of quantised values, lanes summed at fold
        self.s = I.alloc_buffer((B,), "float32")  # scores of the current block
        self.p = I.alloc_buffer((B,), "float32")  # their probabilities (quantised V: times the value scales)
        # quantised V, integer path: p * scale rounded to int_bits bits (16: two int8 halves), times wf
        self.w = _halves_of((B,), int_bits)
        self.wf = I.alloc_buffer((1,), "float32")
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


def _halves_of(shape, bits: int) -> list:
    """int8 buffers holding values rounded to `bits` bits: [high, low] for 16, [value] for 8."""
    return [I.alloc_buffer(shape, "int8") for _ in range(bits // 8)]


class Query:
    """Query heads head0 .. head0+G-1 of token t, scaled by 1/sqrt(hd): qs[g * hd + d]; qk holds q times the
    key scales of the current block (quantised K) and kc[g] = sum_d q_d min_d."""

    def __init__(self, q, t, head0, G: int, hd: int, scale: float, int_bits: int = 0, rotate: bool = False):
        self.G, self.hd = G, hd
        self.qs = I.alloc_buffer((G * hd,), "float32")
        self.qk = I.alloc_buffer((G * hd,), "float32")
        self.kc = I.alloc_buffer((G,), "float32")
        if int_bits:  # qk rounded to int_bits bits per head and block: qk ~ qf[g] * (256 qhi + qlo) or qf[g] * q8
            self.qi = _halves_of((G * hd,), int_bits)
            self.qf = I.alloc_buffer((G,), "float32")
        for g in range(G):
            vecs = [q[t, ramp((head0 + g) * hd + c * L)] for c in range(hd // L)]
            # rotated keys (kv/plan.py): the query rotated alike, the 1/sqrt(hd) folded into the transform's scale
            vecs = hadamard(vecs, scale / hd ** 0.5) if rotate else [v * bc(f32(scale)) for v in vecs]
            for c, v in enumerate(vecs):
                I.buffer_store(self.qs, v, [ramp(g * hd + c * L)])


def attend_block(kv: KVBuffers, qy: Query, layer, kslot, vslot, kvh, b, limit, ring: bool, states) -> None:
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
        if int_scores:  # sum_d q16_d code_d exactly in int32, 4 channels per dot product and half
            sums = GroupSum(kv.dot, G, len(qy.qi))
            sums.zero()
            run = _run(kv.dot, hd // 4, kt.qmax)
            with I.serial(0, hd // 4 // run) as wo:
                for wi in range(run):
                    w = wo * run + wi
                    raw = I.Bind(k_codes_group_u8(kv.k_store, (kslot, kvh, b), kt, sub, w))
                    for g in range(G):
                        _add_halves(sums, g, raw, kt.qmax, qy.qi, g * hd + 4 * w)
                sums.flush()
            for g, st in enumerate(states):
                I.buffer_store(st.s, bc(qy.kc[g]) + bc(qy.qf[g]) * tirx.Cast(F32, sums.total(g)), [ramp(sub * L)])
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
    vector, the codes' with weights w_j = p_j scale_j. Integer path: w rounded to kv.int_bits bits per head
    and block (wf = max w / qmax_of(bits)) and summed over 4 keys per vpdpbusd, as the scores are."""
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
            _split([st.p[ramp(sub * L)] for sub in range(B // L)], st.w, st.wf)
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
    groups = B // 4 // per
    run = _run(kv.dot, groups, vt.qmax)
    with I.serial(0, hd // L, unroll=False) as c:  # rolled: the unrolled key groups inside are enough code
        sums = GroupSum(kv.dot, len(states), kv.int_bits // 8)
        sums.zero()
        with I.serial(0, groups // run) as mo:
            for mi in range(run):
                m = mo * run + mi
                raw = I.Bind(kv.v_store[vslot, kvh, b, c, m, tirx.Ramp(0, 1, 64)])
                halves = [raw] if per == 1 else [nibbles_u8x64(raw, 0), nibbles_u8x64(raw, 1)]
                for h, codes in enumerate(halves):
                    codes = I.Bind(codes)
                    for i, st in enumerate(states):
                        _add_halves(sums, i, codes, vt.qmax, st.w, 4 * (m * per + h))
            sums.flush()
        for i, st in enumerate(states):
            whole = tirx.Cast(F32, sums.total(i))
            I.buffer_store(st.acc, st.acc[ramp(c * L)] + whole * bc(st.wf[0]), [ramp(c * L)])


def qmax_of(bits: int) -> int:
    """The largest rounded magnitude: 127 * 256 keeps both int8 halves of a 16-bit value in [-128, 127] (and
    every sum inside int32); 8-bit values are plain int8 in [-127, 127]."""
    return 127 * 256 if bits == 16 else 127


def _run(dot: Dot, n: int, cmax: int) -> int:
    """Dot products per unrolled loop body: VNNI sums in int32 as it goes (1: the loop stays rolled); AVX2 keeps
    int16 partial sums for as many as its bound allows (byte codes count as nibbles: they are split)."""
    if dot.isa is not IsaClass.AVX2:
        return 1
    depth = Dot.depth(min(cmax, 15))
    return max(d for d in range(1, n + 1) if n % d == 0 and d <= depth)


def _add_halves(sums: GroupSum, slot: int, codes_u8, cmax: int, halves, at) -> None:
    """sums[slot] += the 64 unsigned codes (4 per 32-bit lane, <= cmax) times the 4 int8 factors halves[i][at :
    at + 4] broadcast to every lane, the factor being 256 halves[0] + halves[1] (or halves[0] alone). Byte
    codes are split into nibbles where the dot products saturate on them (AVX2)."""
    if cmax > 15 and sums.dot.split_bytes:
        ops = [(nibbles_u8x64(codes_u8, 0), 15, 0), (nibbles_u8x64(codes_u8, 1), 15, 4)]
    else:
        ops = [(codes_u8, cmax, 0)]
    for codes, c, shift in ops:
        codes = tirx.reinterpret("int8x64", codes)
        for h, half in enumerate(halves):
            word = tirx.reinterpret("int32", half[tirx.Ramp(at, 1, 4)])
            sums.add(slot, h, codes, tirx.reinterpret("int8x64", tirx.Broadcast(word, L)), c, shift)


def _split(vecs, halves: list, scale_buf, at=0, base=0) -> None:
    """vr = round(v / f) with f = max |v| / qmax over the float32x16 vectors `vecs`, stored from base + 16i on:
    16 bits (two halves) as vr = 256 hi + lo in halves [hi, lo]; 8 bits as vr itself. scale_buf[at] = f."""
    i32 = f"int32x{L}"
    qmax = f32(float(qmax_of(8 * len(halves))))

    def i32c(v):
        return bc(tirx.const(v, "int32"))

    mx = tirx.abs(vecs[0])
    for v in vecs[1:]:
        mx = tirx.max(mx, tirx.abs(v))
    amax = I.Bind(hmax(mx))
    inv = I.Bind(tirx.Select(amax > f32(0.0), qmax / amax, f32(0.0)))
    I.buffer_store(scale_buf, amax / qmax, [at])
    for c, v in enumerate(vecs):
        vr = I.Bind(tirx.Cast(i32, tirx.floor(v * bc(inv) + bc(f32(0.5)))))
        if len(halves) == 1:
            I.buffer_store(halves[0], tirx.Cast(f"int8x{L}", vr), [ramp(base + c * L)])
            continue
        lo = I.Bind(((vr + i32c(128)) & i32c(255)) - i32c(128))
        I.buffer_store(halves[1], tirx.Cast(f"int8x{L}", lo), [ramp(base + c * L)])
        I.buffer_store(halves[0], tirx.Cast(f"int8x{L}", (vr - lo) >> i32c(8)), [ramp(base + c * L)])


def _quantise_query(qy: Query) -> None:
    """qk rounded per head (16 bits: two int8 halves, as the integer matmuls split 16-bit activations, the
    scores keeping float32-like precision; 8 bits: as llama.cpp rounds the query against a quantised cache)."""
    for g in range(qy.G):
        vecs = [qy.qk[ramp(g * qy.hd + c * L)] for c in range(qy.hd // L)]
        _split(vecs, qy.qi, qy.qf, g, g * qy.hd)


def attend(kv, qy, layer, kslot, vslot, kvh, b, limit, first_ring, states) -> None:
    """Block b for a query whose ring-precision blocks start at first_ring."""
    with I.If(kv.in_ring(b, first_ring)):
        with I.Then():
            attend_block(kv, qy, layer, kslot, vslot, kvh, b, limit, True, states)
        with I.Else():
            attend_block(kv, qy, layer, kslot, vslot, kvh, b, limit, False, states)


def finish(out, t, kvh, G: int, hd: int, states) -> None:
    for g, st in enumerate(states):
        st.fold()
        inv = I.Bind(f32(1.0) / st.l[0])
        for c in range(hd // L):
            I.buffer_store(out, st.acc[ramp(c * L)] * bc(inv), [t, ramp((kvh * G + g) * hd + c * L)])
