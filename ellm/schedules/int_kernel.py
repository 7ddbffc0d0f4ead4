"""The integer matmul micro-kernel on tile16 weights (quant/tiled.py), for every dot-product class.

Lane r of every 64-byte weight vector is output row 16 * tile + r, so one load feeds 16 rows and per-row
scales are plain vectors. Each group of inputs sharing a weight scale is summed exactly in int32
(schedules/intdot.py), then scaled into float32 accumulators:

  Q4_0  y += d dx (acc - 8 sq)          Q4_1  y += d dx acc + m dx sq      Q8_0  y += d dx (acc - 128 sq)
  Q4_K  y += (d sc) dx acc - (dmin mn) dx sq                           Q6_K  y += (d sc) dx (acc - 32 sq)

(acc: sum of code x xq over the group, sq: sum of xq, dx: the activation scale.) The only error is the
rounding of activations (schedules/int_acts.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.tirx.script.builder import ir as I

from ..quant import QuantType
from .int_acts import F32, I32, L, Acts, ramp, splat
from .intdot import Dot, GroupSum

QUANTIZED = (QuantType.Q4_0, QuantType.Q4_1, QuantType.Q8_0, QuantType.Q4_K, QuantType.Q6_K)
M4 = 0x0F0F0F0F
M30 = 0x30303030


def _bytes(v):
    return tirx.reinterpret("int8x64", v)


@dataclass(frozen=True)
class Operand:
    """One dot-product operand of a row tile: 4 codes (<= cmax) for each of 16 rows, to be weighted by
    2**shift, against the 4 activations at offset `inputs` within the group."""

    weights: tirx.PrimExpr  # u8 x 64 (as int8x64)
    inputs: int
    cmax: int
    shift: int = 0


def operands(qtype: QuantType, w, tile, g, split_bytes: bool = False) -> list[Operand]:
    """The operands of input group g of one row tile. `split_bytes`: Q8_0's byte codes as two nibbles."""
    u32 = lambda v: splat(v, "uint32x16")  # noqa: E731
    if qtype is QuantType.Q8_0:
        words = [w["qs"][tile, g * 8 + i, ramp(0)] for i in range(8)]
        if not split_bytes:
            return [Operand(_bytes(x), 4 * i, 255) for i, x in enumerate(words)]
        return [Operand(_bytes((x >> u32(4 * s)) & u32(M4)), 4 * i, 15, 4 * s) for s in (0, 1) for i, x in enumerate(words)]
    if qtype is QuantType.Q6_K:
        h = w["qh"][tile, g, ramp(0)]
        ops = []
        for o, (lo_h, hi_h) in enumerate(((h & u32(M30), (h >> u32(2)) & u32(M30)),
                                          ((h << u32(4)) & u32(M30), (h << u32(2)) & u32(M30)))):
            ql = w["ql"][tile, g * 2 + o, ramp(0)]
            ops.append(Operand(_bytes((ql & u32(M4)) | lo_h), 8 * o, 63))
            ops.append(Operand(_bytes(((ql >> u32(4)) & u32(M4)) | hi_h), 8 * o + 4, 63))
        return ops
    ops = []
    for o in range(4):  # 4-bit quants: 4 octets of inputs per group of 32
        word = w["qs"][tile, g * 4 + o, ramp(0)]
        ops.append(Operand(_bytes(word & u32(M4)), 8 * o, 15))
        ops.append(Operand(_bytes((word >> u32(4)) & u32(M4)), 8 * o + 4, 15))
    return ops


def group_size(qtype: QuantType) -> int:
    return 16 if qtype is QuantType.Q6_K else 32


def scale_update(qtype: QuantType, w, tile, g, acc, dx, sq) -> tirx.PrimExpr:
    """What one group adds to the float32 accumulator: acc (int32x16), dx (f32 scalar), sq (int32 scalar)."""
    f = lambda v: tirx.Cast(F32, v)  # noqa: E731
    dxv = splat(dx, F32)
    if qtype is QuantType.Q4_0:
        return f(w["d"][tile, g, ramp(0)]) * dxv * f(acc - splat(sq * 8, I32))
    if qtype is QuantType.Q8_0:
        return f(w["d"][tile, g, ramp(0)]) * dxv * f(acc - splat(sq * 128, I32))
    if qtype is QuantType.Q4_1:
        return f(w["d"][tile, g, ramp(0)]) * dxv * f(acc) + f(w["m"][tile, g, ramp(0)]) * splat(dx * tirx.Cast("float32", sq), F32)
    if qtype is QuantType.Q4_K:
        sb = g // 8
        scale = f(w["d"][tile, sb, ramp(0)]) * f(w["sc"][tile, g, ramp(0)])
        minimum = f(w["dmin"][tile, sb, ramp(0)]) * f(w["mn"][tile, g, ramp(0)])
        return scale * dxv * f(acc) - minimum * splat(dx * tirx.Cast("float32", sq), F32)
    if qtype is QuantType.Q6_K:
        scale = f(w["d"][tile, g // 16, ramp(0)]) * f(w["sc"][tile, g, ramp(0)])
        return scale * dxv * f(acc - splat(sq * 32, I32))
    raise AssertionError(qtype)


def group_sq(acts: Acts, t, g, G: int):
    """Sum of token t's quantised activations over input group g (of G inputs)."""
    return acts.sq[t, g * 2] + acts.sq[t, g * 2 + 1] if G == 32 else acts.sq[t, g]


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
    """The usual epilogue: out[t, tile rows] = acc (+ bias) (+ residual)."""

    def store(t, tile, acc) -> None:
        cols = ramp(tile * L)
        v = acc
        if bias is not None:
            v = v + bias[cols]
        if res is not None:
            v = v + res[t, cols]
        I.buffer_store(out, v, [t, cols])

    return store


def micro_kernel(dot: Dot, qtype, w, tiles: list, t0, tt: int, K: int, acts: Acts, epilogue, pf_bytes: int = 0,
                 pf_nta: bool = True, finish=None) -> None:
    """Row tiles `tiles` x tokens [t0, t0 + tt): exact int32 sums per group of inputs, float32 accumulation.

    Then epilogue(t, tile, acc) per token and tile, or, with `finish`, finish(accs) once with
    accs[i][j] the accumulator of token i and tile j (for epilogues that combine tiles).
    """
    G = group_size(qtype)
    nt = len(tiles)
    facc = I.alloc_buffer((tt * nt * L,), "float32")
    slot = lambda i, j: i * nt + j  # noqa: E731  token i, tile j
    for s in range(tt * nt):
        I.buffer_store(facc, splat(0.0, F32), [ramp(s * L)])
    annotations = None
    if pf_bytes:
        names = [w[c].name for c in (("ql", "qh") if qtype is QuantType.Q6_K else ("qs",))]  # the quant streams
        annotations = {"ellm.prefetch": {"buffers": names, "bytes": pf_bytes, "locality": 0 if pf_nta else 3}}
    halves = acts.halves
    with I.serial(0, K // G, annotations=annotations) as g:
        sums = GroupSum(dot, tt * nt, len(halves))
        sums.zero()
        for j, tile in enumerate(tiles):
            for op in operands(qtype, w, tile, g, dot.split_bytes):
                a = I.Bind(op.weights)
                for i in range(tt):
                    for h, xs in enumerate(halves):
                        xb = tirx.reinterpret("int32", xs[t0 + i, tirx.Ramp(g * G + op.inputs, 1, 4)])
                        sums.add(slot(i, j), h, a, _bytes(tirx.Broadcast(xb, L)), op.cmax, op.shift)
        sums.flush()
        for i in range(tt):
            dxi = acts.dx[t0 + i, g * G // 32]
            sqi = group_sq(acts, t0 + i, g, G)
            for j, tile in enumerate(tiles):
                upd = scale_update(qtype, w, tile, g, I.Bind(sums.total(slot(i, j))), dxi, sqi)
                I.buffer_store(facc, facc[ramp(slot(i, j) * L)] + upd, [ramp(slot(i, j) * L)])
    if finish is not None:
        finish([[facc[ramp(slot(i, j) * L)] for j in range(nt)] for i in range(tt)])
        return
    for i in range(tt):
        for j, tile in enumerate(tiles):
            epilogue(t0 + i, tile, facc[ramp(slot(i, j) * L)])
