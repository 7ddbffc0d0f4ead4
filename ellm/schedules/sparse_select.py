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

from .kv_blocks import F32, L, KVBuffers, bc, f32, ramp
from .vecmath import hmax, hreduce, hsum

NEG = -3.0e38
BISECT_STEPS = 26  # float32 has 24 significant bits: the threshold is exact to the bounds' rounding


def block_bounds(kv: KVBuffers, qs, G: int, kvh, kslot, first, n_cand, out, base) -> None:
    """out[base + i] = the score bound of block first + i (i < n_cand) for the query heads in qs[g * hd + d]."""
    hd = kv.plan.head_dim
    kt = kv.kt
    with I.serial(0, n_cand) as i:
        b = first + i
        best = None
        for g in range(G):
            acc = bc(f32(0.0))
            for c in range(hd // L):
                q = qs[ramp(g * hd + c * L)]
                a = tirx.Cast(F32, kv.k_side[kslot, kvh, b, 0, ramp(c * L)])
                z = tirx.Cast(F32, kv.k_side[kslot, kvh, b, 1, ramp(c * L)])
                if kt.is_float:  # summary: (min, max)
                    acc = acc + tirx.max(q * a, q * z)
                else:  # params: (min, scale)
                    acc = acc + q * a + tirx.max(q * z, bc(f32(0.0))) * bc(f32(float(kt.qmax)))
            bound = hsum(acc)
            best = bound if best is None else tirx.max(best, bound)
        I.buffer_store(out, best, [base + i])


def _count_at_least(bounds, base, n, thr):
    """How many of bounds[base : base + n] are >= thr (vectorised; the buffer has 16 spare slots)."""
    cnt = I.alloc_buffer((L,), "int32")
    I.buffer_store(cnt, bc(tirx.const(0, "int32")), [ramp(0)])
    n32 = I.Bind(tirx.Cast("int32", n))
    with I.serial(0, (n + L - 1) // L) as v:
        lanes = ramp(tirx.Cast("int32", v * L)) < bc(n32)  # int32 lanes: one compare, not two of int64
        hit = tirx.Select(lanes & (bounds[ramp(base + v * L)] >= bc(thr)), bc(tirx.const(1, "int32")), bc(tirx.const(0, "int32")))
        I.buffer_store(cnt, cnt[ramp(0)] + hit, [ramp(0)])
    return hsum(cnt[ramp(0)])


def top_k_threshold(bounds, base, n, k):
    """A threshold t with at least k of bounds[base : base + n] >= t and fewer than k above the next float
    step (bisection between the smallest and largest bound). Needs 1 <= k < n."""
    lim = I.alloc_buffer((2,), "float32")  # lo: count >= k; hi: count < k
    mn = I.alloc_buffer((L,), "float32")
    mx = I.alloc_buffer((L,), "float32")
    I.buffer_store(mn, bc(f32(-NEG)), [ramp(0)])
    I.buffer_store(mx, bc(f32(NEG)), [ramp(0)])
    with I.serial(0, (n + L - 1) // L) as v:
        lanes = ramp(v * L) < bc(n)
        x = bounds[ramp(base + v * L)]
        I.buffer_store(mn, tirx.Select(lanes, tirx.min(mn[ramp(0)], x), mn[ramp(0)]), [ramp(0)])
        I.buffer_store(mx, tirx.Select(lanes, tirx.max(mx[ramp(0)], x), mx[ramp(0)]), [ramp(0)])
    I.buffer_store(lim, hreduce(mn[ramp(0)], tirx.min), [0])
    top = I.Bind(hmax(mx[ramp(0)]))
    I.buffer_store(lim, top + tirx.max(tirx.abs(top), f32(1.0)), [1])
    done = I.alloc_buffer((1,), "int32")  # exactly k at or above lim[0]: the same blocks as any later step
    I.buffer_store(done, tirx.const(0, "int32"), [0])
    with I.serial(0, BISECT_STEPS):
        with I.If(done[0] == 0):
            with I.Then():
                mid = I.Bind(lim[0] + (lim[1] - lim[0]) * f32(0.5))
                count = I.Bind(tirx.Cast("int64", _count_at_least(bounds, base, n, mid)))
                with I.If(count >= k):
                    with I.Then():
                        I.buffer_store(lim, mid, [0])
                        I.buffer_store(done, tirx.Cast("int32", count == k), [0])
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


