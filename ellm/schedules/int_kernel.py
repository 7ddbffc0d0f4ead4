"""The integer matmul micro-kernel on tile16 weights (quant/tiled.py), for every dot-product class.

Lane r of every 64-byte weight vector is output row 16 * tile + r, so one load feeds 16 rows and per-row
scales are plain vectors. Each group of inputs sharing a weight scale is summed exactly in int32
(schedules/intdot.py), then scaled into float32 accumulators:

  Q4_0  y += d dx acc - 8 d (dx sq)      Q4_1  y += d dx acc + m (dx sq)      Q8_0  y += d dx acc - 128 d (dx sq)
  Q4_K  y += (d sc) dx acc - (dmin mn) (dx sq)                         Q6_K  y += (d sc) dx acc - 32 (d sc) (dx sq)

(acc: sum of code x xq over the group, sq: sum of xq, dx: the activation scale; dx sq is computed once per
token and group, schedules/int_acts.py, so the weight-side factors are the same for every token of a tile.)
The error is the rounding of activations, then float32 rounding (2**-24 relative) of acc and of the two
products, which the offset formats' cancellation (acc against 8 sq, say) magnifies by at most its ratio.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.tirx.script.builder import ir as I

from ..quant import QuantType
from .int_acts import L, Acts
from .intdot import Dot, GroupSum
from .space import Knob

QUANTIZED = (QuantType.Q4_0, QuantType.Q4_1, QuantType.Q8_0, QuantType.Q4_K, QuantType.Q6_K)
M4 = 0x0F0F0F0F
M30 = 0x30303030


PREFETCH_LOCALITY = Knob("prefetch_locality", 0, (0, 1, 2, 3),
                         "prefetch kind in the weight stream: LLVM locality 0 (prefetchnta), 1 (t2), 2 (t1), 3 (t0)")


def default_locality(target) -> int:
    """The preset's prefetch kind: prefetchnta where it measured faster (AMD), else prefetcht0."""
    return 0 if target.prefetch_nta else 3


def without_moot_locality(knobs, target, bytes_knob: str = "prefetch_bytes") -> dict[str, int]:
    """`knobs` with the prefetch kind at the preset's when nothing is prefetched (it is moot then)."""
    out = dict(knobs)
    if out.get(bytes_knob) == 0 and "prefetch_locality" in out:
        out["prefetch_locality"] = default_locality(target)
    return out


@dataclass(frozen=True)
class Rows:
    """The output rows a micro-kernel slot covers: lanes first .. first + n - 1 of row tile `tile` (the whole
    tile, n = 16, or one half of it, n = 8: a ymm register on AVX2)."""

    tile: object
    first: int = 0
    n: int = L

    @property
    def lanes(self):
        return tirx.Ramp(self.first, 1, self.n)

    @property
    def out(self):
        """The output columns these rows write."""
        return tirx.Ramp(self.tile * L + self.first, 1, self.n)

    def splat(self, v, dtype: str):
        scalar = dtype.split("x")[0]
        return tirx.Broadcast(tirx.const(v, scalar) if isinstance(v, (int, float)) else v, self.n)

    def vec(self, scalar: str) -> str:
        return f"{scalar}x{self.n}"


def tile_rows(tiles: list, n: int = L) -> list[Rows]:
    """Row tiles as slots of n lanes (16: whole tiles; 8: both halves of each)."""
    return [Rows(t, first, n) for t in tiles for first in range(0, L, n)]


@dataclass(frozen=True)
class Operand:
    """One dot-product operand of some rows: 4 codes (<= cmax) per row, to be weighted by 2**shift, against the
    4 activations at offset `inputs` within the group."""

    weights: tirx.PrimExpr  # u8 x 4n (as int8 lanes)
    inputs: int
    cmax: int
    shift: int = 0


def operands(qtype: QuantType, w, rows: Rows, g, split_bytes: bool = False) -> list[Operand]:
    """The operands of input group g of `rows`. `split_bytes`: Q8_0's byte codes as two nibbles."""
    u32 = lambda v: rows.splat(v, "uint32")  # noqa: E731
    tile, lanes = rows.tile, rows.lanes
    _bytes = lambda v: tirx.reinterpret(f"int8x{4 * rows.n}", v)  # noqa: E731
    if qtype is QuantType.Q8_0:
        words = [w["qs"][tile, g * 8 + i, lanes] for i in range(8)]
        if not split_bytes:
            return [Operand(_bytes(x), 4 * i, 255) for i, x in enumerate(words)]
        return [Operand(_bytes((x >> u32(4 * s)) & u32(M4)), 4 * i, 15, 4 * s) for s in (0, 1) for i, x in enumerate(words)]
    if qtype is QuantType.Q6_K:
        h = w["qh"][tile, g, lanes]
        ops = []
        for o, (lo_h, hi_h) in enumerate(((h & u32(M30), (h >> u32(2)) & u32(M30)),
                                          ((h << u32(4)) & u32(M30), (h << u32(2)) & u32(M30)))):
            ql = w["ql"][tile, g * 2 + o, lanes]
            ops.append(Operand(_bytes((ql & u32(M4)) | lo_h), 8 * o, 63))
            ops.append(Operand(_bytes(((ql >> u32(4)) & u32(M4)) | hi_h), 8 * o + 4, 63))
        return ops
    ops = []
    for o in range(4):  # 4-bit quants: 4 octets of inputs per group of 32
        word = w["qs"][tile, g * 4 + o, lanes]
        ops.append(Operand(_bytes(word & u32(M4)), 8 * o, 15))
        ops.append(Operand(_bytes((word >> u32(4)) & u32(M4)), 8 * o + 4, 15))
    return ops


def group_size(qtype: QuantType) -> int:
    return 16 if qtype is QuantType.Q6_K else 32


def accumulate(qtype: QuantType, w, rows: Rows, g, facc, acc, dx, ds) -> tirx.PrimExpr:
    """The float32 accumulator of `rows` after input group g: facc plus the group's scaled integer sum `acc`
    (int32 lanes); dx (the group's activation scale) and ds (dx times the sum of its quantised activations:
    Acts.ds) are f32 scalars. Two multiply-adds per token: the weight-side factors do not depend on it."""
    F = rows.vec("float32")
    f = lambda v: tirx.Cast(F, v)  # noqa: E731
    tile, lanes = rows.tile, rows.lanes
    dxv, dsv = rows.splat(dx, "float32"), rows.splat(ds, "float32")
    if qtype in (QuantType.Q4_0, QuantType.Q8_0, QuantType.Q4_1):
        scale = f(w["d"][tile, g, lanes])
        offset = {QuantType.Q4_0: -8.0, QuantType.Q8_0: -128.0}.get(qtype)
        shift = scale * rows.splat(offset, "float32") if offset is not None else f(w["m"][tile, g, lanes])
    elif qtype is QuantType.Q4_K:
        sb = g // 8
        scale = f(w["d"][tile, sb, lanes]) * f(w["sc"][tile, g, lanes])
        shift = -(f(w["dmin"][tile, sb, lanes]) * f(w["mn"][tile, g, lanes]))
    elif qtype is QuantType.Q6_K:
        scale = f(w["d"][tile, g // 16, lanes]) * f(w["sc"][tile, g, lanes])
        shift = scale * rows.splat(-32.0, "float32")
    else:
        raise AssertionError(qtype)
    # y += scale dx acc + shift dx sq (shift: the code offset or the minimum, times the scale)
    return facc + (scale * dxv) * f(acc) + shift * dsv


def for_token_tiles(m, n_tok, tokens_per_tile: int, body) -> None:
    """body(t0, tt) over tiles of `tokens_per_tile` tokens, then single tokens for the remainder."""
    tt = min(tokens_per_tile, m) if m is not None else tokens_per_tile
    if m is not None and m % tt == 0:
        with I.serial(0, m // tt) as tb:
            body(tb * tt, tt)
        return
    with I.serial(0, n_tok // tt) as tb:
        body(tb * tt, tt)
    with I.serial(n_tok // tt * tt, n_tok) as t:
        body(t, 1)


def store_epilogue(out, res, bias):
    """The usual epilogue: out[t, rows] = acc (+ bias) (+ residual)."""

    def store(t, rows: Rows, acc) -> None:
        cols = rows.out
        v = acc
        if bias is not None:
            v = v + bias[cols]
        if res is not None:
            v = v + res[t, cols]
        I.buffer_store(out, v, [t, cols])

    return store


def micro_kernel(dot: Dot, qtype, w, slots: list[Rows], t0, tt: int, K: int, acts: Acts, epilogue, pf_bytes: int = 0,
                 pf_locality: int = 0, finish=None, group_unroll: int = 1) -> None:
    """Output rows `slots` (whole row tiles, or halves of them: see Rows) x tokens [t0, t0 + tt): exact int32
    sums per group of inputs, float32 accumulation, one accumulator per token and slot.

    Then epilogue(t, rows, acc) per token and slot, or, with `finish`, finish(accs) once with accs[i][j] the
    accumulator of token i and slot j (for epilogues that combine tiles). `group_unroll` groups of inputs
    run per iteration of the reduction loop (it must divide K / group); `pf_bytes` > 0 prefetches the quant
    streams that far ahead with LLVM locality `pf_locality` (0: prefetchnta .. 3: prefetcht0).
    """
    G = group_size(qtype)
    ns = len(slots)
    lanes = slots[0].n
    assert all(r.n == lanes for r in slots)
    # one small buffer per accumulator: LLVM keeps each in a register (one large one stays on the stack)
    facc = [[I.alloc_buffer((lanes,), "float32") for _ in slots] for _ in range(tt)]
    whole = tirx.Ramp(0, 1, lanes)
    for i in range(tt):
        for j, r in enumerate(slots):
            I.buffer_store(facc[i][j], r.splat(0.0, "float32"), [whole])
    annotations = None
    if pf_bytes:
        names = [w[c].name for c in (("ql", "qh") if qtype is QuantType.Q6_K else ("qs",))]  # the quant streams
        annotations = {"ellm.prefetch": {"buffers": names, "bytes": pf_bytes, "locality": pf_locality}}
    assert (K // G) % group_unroll == 0, (K, G, group_unroll)
    with I.serial(0, K // G // group_unroll, annotations=annotations) as go:
        for u in range(group_unroll):
            _group(dot, qtype, w, slots, t0, tt, acts, facc, go * group_unroll + u, G)
    if finish is not None:
        finish([[facc[i][j][whole] for j in range(ns)] for i in range(tt)])
        return
    for i in range(tt):
        for j, r in enumerate(slots):
            epilogue(t0 + i, r, facc[i][j][whole])


def _group(dot: Dot, qtype, w, slots: list[Rows], t0, tt: int, acts: Acts, facc, g, G: int) -> None:
    """Input group g of every token and slot: exact int32 sums, then the float32 accumulators."""
    ns, lanes = len(slots), slots[0].n
    whole = tirx.Ramp(0, 1, lanes)
    halves = acts.halves
    sums = GroupSum(dot, tt * ns, len(halves), lanes)
    sums.zero()
    for j, r in enumerate(slots):
        for op in operands(qtype, w, r, g, dot.split_bytes):
            a = I.Bind(op.weights)
            for i in range(tt):
                for h, xs in enumerate(halves):
                    xb = tirx.reinterpret("int32", xs[t0 + i, tirx.Ramp(g * G + op.inputs, 1, 4)])
                    factors = tirx.reinterpret(f"int8x{4 * lanes}", tirx.Broadcast(xb, lanes))
                    sums.add(i * ns + j, h, a, factors, op.cmax, op.shift)
    sums.flush()
    for i in range(tt):
        dxi, dsi = acts.dx[t0 + i, g * G // 32], acts.ds(t0 + i, g, G)
        for j, r in enumerate(slots):
            new = accumulate(qtype, w, r, g, facc[i][j][whole], I.Bind(sums.total(i * ns + j)), dxi, dsi)
            I.buffer_store(facc[i][j], new, [whole])
