"""Dequantisation as TIR expressions, one per weight format, bit-exact with `gguf.quants.dequantize`.

Every expression reads the packed components at (row n, block b, in-block sub-indices) and follows
GGUF's float32 operation order. LLVM may contract `d * q + m` into an FMA; that changes nothing,
because every product here is exact in float32: an f16 scale has 11 significant bits, a Q4_K 6-bit
scale adds 6 and a 4-bit quant 4 (21 <= 24); Q6_K's int8 scale adds 7 and its 6-bit quant 5 (23).
"""

from __future__ import annotations

from typing import Mapping, Sequence

from tvm import te, tirx

from ..quant import QuantType, WeightFormat

F32 = "float32"


def sub_strides(fmt: WeightFormat) -> tuple[int, ...]:
    strides, s = [], 1
    for e in reversed(fmt.sub_axes):
        strides.append(s)
        s *= e
    return tuple(reversed(strides))


def flat_k(fmt: WeightFormat, b, sub: Sequence) -> tirx.PrimExpr:
    """Column index of the element at block b, sub-indices `sub`."""
    k = b * fmt.block
    for s, stride in zip(sub, sub_strides(fmt)):
        k = k + s * stride
    return k


def split_k(fmt: WeightFormat, k) -> tuple:
    """Inverse of `flat_k`: column index -> (block, sub-indices)."""
    b = k // fmt.block
    r = k % fmt.block
    sub = tuple((r // stride) % extent for stride, extent in zip(sub_strides(fmt), fmt.sub_axes))
    return b, sub


def _f(x):
    return x.astype(F32)


def _nib(byte, shift):
    """(byte >> shift) & 0xF for a uint8 byte and an integer shift expression."""
    return (byte >> tirx.Cast("uint8", shift)) & tirx.const(0xF, "uint8")


def dequant(fmt: WeightFormat, w: Mapping[str, te.Tensor], n, b, sub: Sequence) -> tirx.PrimExpr:
    """float32 value of weight (row n, block b, sub-indices) from component tensors `w`."""
    q = fmt.qtype
    if q is QuantType.F32:
        return w["w"][n, flat_k(fmt, b, sub)]
    if q is QuantType.F16:
        return _f(w["w"][n, flat_k(fmt, b, sub)])
    if q is QuantType.BF16:
        bits = w["w"][n, flat_k(fmt, b, sub)].astype("uint32") << tirx.const(16, "uint32")
        return tirx.reinterpret(F32, bits)
    if q is QuantType.Q8_0:
        (i,) = sub
        return _f(w["qs"][n, b * 32 + i]) * _f(w["d"][n, b])
    if q in (QuantType.Q4_0, QuantType.Q4_1):
        h, l = sub  # element 16h + l of the block: byte l, nibble h
        nib = _nib(w["qs"][n, b * 16 + l], h * 4)
        if q is QuantType.Q4_0:
            return _f(w["d"][n, b]) * _f(nib.astype("int32") - 8)
        return _f(w["d"][n, b]) * _f(nib) + _f(w["m"][n, b])
    if q is QuantType.Q4_K:
        c, h, l = sub  # 64-element chunk c, nibble h (sub-block 2c + h), byte l of the chunk
        j = b * 8 + c * 2 + h
        nib = _nib(w["qs"][n, b * 128 + c * 32 + l], h * 4)
        scale = _f(w["d"][n, b]) * _f(w["sc"][n, j])
        minimum = _f(w["dmin"][n, b]) * _f(w["mn"][n, j])
        return scale * _f(nib) - minimum
    if q is QuantType.Q6_K:
        h, r, s, l = sub  # half h, quarter r (of 32), 16-group s, lane l
        lo = _nib(w["ql"][n, b * 128 + h * 64 + (r % 2) * 32 + s * 16 + l], (r // 2) * 4)
        hi = (w["qh"][n, b * 64 + h * 32 + s * 16 + l] >> tirx.Cast("uint8", r * 2)) & tirx.const(3, "uint8")
        q6 = (lo | (hi << tirx.const(4, "uint8"))).astype("int32") - 32
        scale = _f(w["d"][n, b]) * _f(w["sc"][n, b * 16 + h * 8 + r * 2 + s])
        return scale * _f(q6)
    raise AssertionError(q)


def weight_placeholders(fmt: WeightFormat, rows: int, cols: int, prefix: str = "w") -> dict[str, te.Tensor]:
    """One TE placeholder per packed component, in the format's component order."""
    return {
        c.name: te.placeholder(fmt.component_shape(c, rows, cols), c.dtype, name=f"{prefix}_{c.name}")
        for c in fmt.components
    }


def split_row_loop(sch, block, fmt: WeightFormat):
    """Split a block's last (column) loop into (block, *sub_axes) so every packed index is affine, and
    vectorise the contiguous innermost sub-axis. Returns the new loops."""
    loops = sch.split(sch.get_loops(block)[-1], [None, *fmt.sub_axes])
    sch.vectorize(loops[-1])
    for lp in loops[1:-1]:
        sch.unroll(lp)
    return loops


def dequant_kernel(fmt: WeightFormat, rows: int, cols: int):
    """A kernel expanding a packed [rows, cols] weight to float32 with the same expressions and vector lanes
    the kernels use. For tests and debugging."""
    import tvm

    w = weight_placeholders(fmt, rows, cols)
    out = te.compute((rows, cols), lambda n, k: dequant(fmt, w, n, *split_k(fmt, k)), name="deq")
    sch = tvm.s_tir.Schedule(te.create_prim_func([*w.values(), out]))
    block = sch.get_sblock("deq")
    sch.parallel(sch.get_loops(block)[0])
    split_row_loop(sch, block, fmt)
    return sch.mod["main"]


def dequant_tiled(qtype: QuantType, w: Mapping[str, te.Tensor], n, k) -> tirx.PrimExpr:
    """float32 value of weight (row n, input k) from tile16 components (quant/tiled.py), bit-exact with GGUF."""
    tile, r = n // 16, n % 16
    if qtype is QuantType.F32:
        return w["w"][tile, k, r]
    if qtype is QuantType.F16:
        return _f(w["w"][tile, k, r])
    if qtype is QuantType.BF16:
        return tirx.reinterpret(F32, w["w"][tile, k, r].astype("uint32") << tirx.const(16, "uint32"))

    def nibble(buf):  # byte j of the octet word: input j low nibble, input j + 4 high nibble
        j = k % 8
        shift = (j % 4) * 8 + (j // 4) * 4
        return (buf[tile, k // 8, r] >> tirx.Cast("uint32", shift)) & tirx.const(0xF, "uint32")

    if qtype is QuantType.Q8_0:
        byte = (w["qs"][tile, k // 4, r] >> tirx.Cast("uint32", (k % 4) * 8)) & tirx.const(0xFF, "uint32")
        return _f(byte.astype("int32") - 128) * _f(w["d"][tile, k // 32, r])
    if qtype is QuantType.Q4_0:
        return _f(w["d"][tile, k // 32, r]) * _f(nibble(w["qs"]).astype("int32") - 8)
    if qtype is QuantType.Q4_1:
        return _f(w["d"][tile, k // 32, r]) * _f(nibble(w["qs"])) + _f(w["m"][tile, k // 32, r])
    if qtype is QuantType.Q4_K:
        scale = _f(w["d"][tile, k // 256, r]) * _f(w["sc"][tile, k // 32, r])
        minimum = _f(w["dmin"][tile, k // 256, r]) * _f(w["mn"][tile, k // 32, r])
        return scale * _f(nibble(w["qs"])) - minimum
    if qtype is QuantType.Q6_K:
        j, odd = k % 8, (k // 8) % 2
        shift = (j % 4) * 8 + (j // 4) * 2 + (1 - odd) * 4
        hi = (w["qh"][tile, k // 16, r] >> tirx.Cast("uint32", shift)) & tirx.const(3, "uint32")
        q6 = (nibble(w["ql"]) | (hi << tirx.const(4, "uint32"))).astype("int32") - 32
        return (_f(w["d"][tile, k // 256, r]) * _f(w["sc"][tile, k // 16, r])) * _f(q6)
    raise AssertionError(qtype)


def tiled_placeholders(qtype: QuantType, rows: int, cols: int, prefix: str = "w") -> dict[str, te.Tensor]:
    from ..quant.tiled import TILED_COMPONENTS

    return {c.name: te.placeholder(c.shape(rows, cols), c.dtype, name=f"{prefix}_{c.name}") for c in TILED_COMPONENTS[qtype]}


def dequant_tiled_kernel(qtype: QuantType, rows: int, cols: int):
    """Expand a tile16 weight to float32 [rows, cols] (tests and debugging)."""
    import tvm

    w = tiled_placeholders(qtype, rows, cols)
    out = te.compute((rows, cols), lambda n, k: dequant_tiled(qtype, w, n, k), name="deq")
    sch = tvm.s_tir.Schedule(te.create_prim_func([*w.values(), out]))
    sch.parallel(sch.get_loops(sch.get_sblock("deq"))[0])
    return sch.mod["main"]
