"""The list of blocks a query reads (sparse: the sink blocks, the selected candidates, the window; dense:
every block), the selection that fills it, and dynamic widening once it has been read."""

from __future__ import annotations

from tvm import tirx
from tvm.tirx.script.builder import ir as I

from .attention_block import Query, attend_block
from .kv_blocks import KVBuffers, f32
from .sparse_select import NEG, block_bounds, collect_selected, top_k_threshold


class ReadShape:
    """Which blocks a query at position n_ctx - 1 of `layer` reads, from the run-time config
    attn[layer] = [sinks, window, topk, widen, margin] (topk < 0: dense). Items of its read list: the sink blocks
    [0, sb) (the first `sinks` tokens rounded up to whole blocks), the selected blocks of the candidates
    [sb, wb), the window blocks [wb, cur]. Dense, or too few candidates to choose from: sb = 0, wb = 0."""

    def __init__(self, kv: KVBuffers, attn_all, layer, n_ctx):
        B = kv.block
        attn = [attn_all[layer, j] for j in range(5)]
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
        self.dense = I.Bind(opaque(tirx.Select(tirx.any(self.topk < 0, wb - sb <= self.topk), 1, 0), "int32"))
        self.sb = I.Bind(opaque(tirx.Select(self.dense == 1, zero, sb)))
        self.wb = I.Bind(opaque(tirx.Select(self.dense == 1, zero, wb)))
        self.n_cand = I.Bind(self.wb - self.sb)


def select_blocks(kv, qy, G, kvh, kslot, sh: ReadShape, bounds, bbase, sel, sbase, count):
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


def widen(kv, qy: Query, layer, kslot, vslot, kvh, sh: ReadShape, bounds, bbase, thr, last_sel, states, sel, sbase,
          count, prefetch: bool = False, locality: int = 2) -> None:
    """Dynamic widening for the G query heads of KV head kvh (they share blocks, as the selection does):
    while the best unread block's bound (the largest over the G heads) is within `margin` of the lowest of
    the heads' best scores read so far, read it too for all G heads (at most `widen` blocks), in decreasing
    bound order. The unread blocks that can be reached are the `widen` next ones by bound: found once (a
    second bisection), listed after the selection in sel[sbase + count :] and sorted by decreasing bound
    (ties in block order), so each step takes the next (and with `prefetch`, prefetches the one after it, with
    LLVM locality `locality`, as the read list's prefetches)."""
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
            if prefetch:
                with I.If(nw[0] > 0):
                    with I.Then():
                        kv.prefetch_block(kslot, vslot, kvh, sh.sb + tirx.Cast("int64", sel[at]), locality)
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
                        if prefetch:
                            with I.If(j + 1 < nw[0]):
                                with I.Then():
                                    kv.prefetch_block(kslot, vslot, kvh, sh.sb + tirx.Cast("int64", sel[at + j + 1]), locality)
                        attend_block(kv, qy, layer, kslot, vslot, kvh, sh.sb + i, sh.n_ctx, False, states)
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


def list_item(sh: ReadShape, i, count, sel_at):
    """Block of item i of a query's read list (see ReadShape), computed with statements into a small buffer:
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


def opaque(value, dtype: str = "int64"):
    """`value` through a one-element buffer: later uses see a load, not the expression (TVM's buffer-region
    analysis substitutes let-bound expressions and slows to minutes on nested selects)."""
    buf = I.alloc_buffer((1,), dtype)
    I.buffer_store(buf, value, [0])
    return buf[0]


def n_items(sh: ReadShape, count):
    return sh.sb + count + sh.cur + 1 - sh.wb
