"""Choosing the key blocks a block-sparse query reads: upper bounds on its scores from each block's
per-channel key range (Quest), a top-K threshold found by bisection, and the ordered block list.

For a query head with scaled q and a block whose channel d lies in [lo_d, hi_d], every score is at most
sum_d max(q_d lo_d, q_d hi_d). Quantised keys (min, scale per channel) lie in [min, min + qmax scale],
so the bound is sum_d q_d min_d + qmax sum_d max(0, q_d scale_d): the selection reads only the params.
A block's bound is the largest over the G query heads that share it.
"""

from __future__ import annotations

from tvm import tirx
from tvm.tirx.script.builder import ir as I

from .kv_blocks import F32, L, KVBuffers
from .vecmath import hmax, hreduce, hsum

NEG = -3.0e38
BISECT_STEPS = 26  # float32 has 24 significant bits: the threshold is exact to the bounds' rounding


def _ramp(base, n=L):
    return tirx.Ramp(base, 1, n)


def _bc(v, n=L):
    return tirx.Broadcast(v, n)


def _f32(v):
    return tirx.const(v, "float32")


def block_bounds(kv: KVBuffers, qs, G: int, kvh, kslot, first, n_cand, out, base) -> None:
    """out[base + i] = the score bound of block first + i (i < n_cand) for the query heads in qs[g * hd + d]."""
    hd = kv.plan.head_dim
    kt = kv.kt
    with I.serial(0, n_cand) as i:
        b = first + i
        best = None
        for g in range(G):
            acc = _bc(_f32(0.0))
            for c in range(hd // L):
                q = qs[_ramp(g * hd + c * L)]
                a = tirx.Cast(F32, kv.k_side[kslot, kvh, b, 0, _ramp(c * L)])
                z = tirx.Cast(F32, kv.k_side[kslot, kvh, b, 1, _ramp(c * L)])
                if kt.is_float:  # summary: (min, max)
                    acc = acc + tirx.max(q * a, q * z)
                else:  # params: (min, scale)
                    acc = acc + q * a + tirx.max(q * z, _bc(_f32(0.0))) * _bc(_f32(float(kt.qmax)))
            bound = hsum(acc)
            best = bound if best is None else tirx.max(best, bound)
        I.buffer_store(out, best, [base + i])


def _count_at_least(bounds, base, n, thr):
    """How many of bounds[base : base + n] are >= thr (vectorised; the buffer has 16 spare slots)."""
    cnt = I.alloc_buffer((L,), "int32")
    I.buffer_store(cnt, _bc(tirx.const(0, "int32")), [_ramp(0)])
    with I.serial(0, (n + L - 1) // L) as v:
        lanes = _ramp(v * L) < _bc(n)
        hit = tirx.Select(lanes & (bounds[_ramp(base + v * L)] >= _bc(thr)), _bc(tirx.const(1, "int32")), _bc(tirx.const(0, "int32")))
        I.buffer_store(cnt, cnt[_ramp(0)] + hit, [_ramp(0)])
    return hsum(cnt[_ramp(0)])


def top_k_threshold(bounds, base, n, k):
    """A threshold t with at least k of bounds[base : base + n] >= t and fewer than k above the next float
    step (bisection between the smallest and largest bound). Needs 1 <= k < n."""
    lim = I.alloc_buffer((2,), "float32")  # lo: count >= k; hi: count < k
    mn = I.alloc_buffer((L,), "float32")
    mx = I.alloc_buffer((L,), "float32")
    I.buffer_store(mn, _bc(_f32(-NEG)), [_ramp(0)])
    I.buffer_store(mx, _bc(_f32(NEG)), [_ramp(0)])
    with I.serial(0, (n + L - 1) // L) as v:
        lanes = _ramp(v * L) < _bc(n)
        x = bounds[_ramp(base + v * L)]
        I.buffer_store(mn, tirx.Select(lanes, tirx.min(mn[_ramp(0)], x), mn[_ramp(0)]), [_ramp(0)])
        I.buffer_store(mx, tirx.Select(lanes, tirx.max(mx[_ramp(0)], x), mx[_ramp(0)]), [_ramp(0)])
    I.buffer_store(lim, hreduce(mn[_ramp(0)], tirx.min), [0])
    top = I.Bind(hmax(mx[_ramp(0)]))
    I.buffer_store(lim, top + tirx.max(tirx.abs(top), _f32(1.0)), [1])
    with I.serial(0, BISECT_STEPS):
        mid = I.Bind(lim[0] + (lim[1] - lim[0]) * _f32(0.5))
        with I.If(_count_at_least(bounds, base, n, mid) >= k):
            with I.Then():
                I.buffer_store(lim, mid, [0])
            with I.Else():
                I.buffer_store(lim, mid, [1])
    return lim[0]


def collect_selected(bounds, base, first, n, thr, k, sel, sel_base, count) -> None:
    """sel[sel_base + j] = the first k blocks first + i (in order) whose bound bounds[base + i] >= thr;
    count[0] = how many."""
    I.buffer_store(count, tirx.const(0, "int32"), [0])
    with I.serial(0, n) as i:
        with I.If(tirx.all(bounds[base + i] >= thr, count[0] < k)):
            with I.Then():
                I.buffer_store(sel, tirx.Cast("int32", first + i), [sel_base + count[0]])
                I.buffer_store(count, count[0] + 1, [0])


