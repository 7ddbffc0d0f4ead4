"""Exact integer dot products per ISA class: 16 lanes of int32, each the sum of 4 u8 x s8 products.

Every integer kernel (matmuls, the fused attention input, the quantised KV cache's scores and values)
multiplies unsigned codes by signed int8 factors, 4 per 32-bit lane, 16 lanes (64 bytes) at a time, and
needs the sums exactly in int32. How depends on the ISA class (targets/isa.py):

* AVX-512 VNNI: one `vpdpbusd` on zmm.
* AVX-VNNI: two `vpdpbusd` on ymm (VEX encoding), one per 32-byte half.
* AVX2: `vpmaddubsw` (u8 x s8, adjacent pairs summed into int16) then `vpmaddwd` against constant factors
  (pairs of int16 summed into int32). `vpmaddubsw` saturates at 32767, so exactness rests on bounds:
  factors are int8 halves, |f| <= 128, and every code operand is at most `cmax`; a pair is then at most
  2 * 128 * cmax, and `GroupSum` adds at most `depth(cmax)` = floor(32767 / (256 cmax)) such results in
  int16 before widening (8 for 4-bit codes, 2 for Q6_K's 6-bit codes). Codes of 8 bits would overflow a
  single pair (2 * 255 * 128 = 65280), so on AVX2 they are split into nibbles (`split_bytes`), the high
  one weighted by 16 in the widening `vpmaddwd`, which also weights the high byte of 16-bit factors by 256.
  Targets with AVX-512 BW (Skylake-SP) run the same sequence on zmm.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.tirx.script.builder import ir as I

from ..targets import IsaClass, TargetPreset, dot_class

L = 16  # int32 lanes of one dot product (64 bytes of codes)
I32 = f"int32x{L}"
I16 = f"int16x{2 * L}"
INT16_MAX = 32767
FACTOR_MAX = 128  # |int8 factor|


def _halves(v, lanes: int):
    h = lanes // 2
    return tirx.Shuffle([v], list(range(h))), tirx.Shuffle([v], list(range(h, lanes)))


def _concat(a, b, lanes: int):
    return tirx.Shuffle([a, b], list(range(lanes)))


def _bc(v, dtype: str, lanes: int):
    return tirx.Broadcast(tirx.const(v, dtype), lanes) if isinstance(v, int) else tirx.Broadcast(v, lanes)


def _lanes(v) -> int:
    import tvm

    return tvm.DataType(str(v.ty.dtype)).lanes


@dataclass(frozen=True)
class Dot:
    """The dot-product instructions of one ISA class (`width`: register bits they run on). Operands are 32 or
    64 bytes of codes (8 or 16 int32 lanes); 64-byte ones run as two 32-byte halves where width is 256."""

    isa: IsaClass
    width: int

    @property
    def split_bytes(self) -> bool:
        """Full-range byte codes must be split into nibbles (vpmaddubsw would saturate on them)."""
        return self.isa is IsaClass.AVX2

    @property
    def label(self) -> str:
        return {IsaClass.AVX2: "vpmaddubsw+vpmaddwd", IsaClass.AVX_VNNI: "vpdpbusd (ymm)",
                IsaClass.AVX512_VNNI: "vpdpbusd (zmm)"}[self.isa]

    def dpbusd(self, acc, a_u8, b_s8):
        """acc (int32 lanes) + the 4-byte lane dots of a (codes, int8 holding u8) and b (int8): VNNI only."""
        assert self.isa is not IsaClass.AVX2, self.isa
        n = _lanes(acc)
        if n * 32 <= self.width:
            return tirx.call_llvm_pure_intrin(f"int32x{n}", f"llvm.x86.avx512.vpdpbusd.{n * 32}", acc, a_u8, b_s8)
        (a0, a1), (b0, b1), (c0, c1) = _halves(a_u8, 4 * n), _halves(b_s8, 4 * n), _halves(acc, n)
        r = [self.dpbusd(c, a, b) for c, a, b in ((c0, a0, b0), (c1, a1, b1))]
        return _concat(r[0], r[1], n)

    def maddubs(self, a_u8, b_s8):
        """int16 lanes: sums of adjacent u8 x s8 products (saturating; see the module's bounds)."""
        nb = _lanes(a_u8)
        if nb * 8 == 512 and self.width == 512:
            return tirx.call_llvm_pure_intrin(I16, "llvm.x86.avx512.pmaddubs.w.512", a_u8, b_s8)
        if nb == 32:
            return tirx.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", a_u8, b_s8)
        (a0, a1), (b0, b1) = _halves(a_u8, nb), _halves(b_s8, nb)
        return _concat(self.maddubs(a0, b0), self.maddubs(a1, b1), nb // 2)

    def maddwd(self, p16, factor: int):
        """int32 lanes: adjacent int16 pairs of p16, each times `factor`, summed."""
        n16 = _lanes(p16)
        f = _bc(factor, "int16", n16)
        if n16 == 32 and self.width == 512:
            return tirx.call_llvm_pure_intrin(I32, "llvm.x86.avx512.pmaddw.d.512", p16, f)
        if n16 == 16:
            return tirx.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", p16, f)
        (p0, p1) = _halves(p16, n16)
        return _concat(self.maddwd(p0, factor), self.maddwd(p1, factor), n16 // 2)

    @staticmethod
    def depth(cmax: int) -> int:
        """How many vpmaddubsw results of codes <= cmax may be summed in int16 without overflow."""
        d = INT16_MAX // (2 * FACTOR_MAX * cmax)
        if d < 1:
            raise ValueError(f"codes up to {cmax} saturate vpmaddubsw: split them")
        return d


def dot_for(target: TargetPreset) -> Dot | None:
    """The dot-product instructions integer kernels use on `target` (None: no integer path)."""
    if target.isa is None:
        return None
    isa = dot_class(target.isa)
    return Dot(isa, 512 if isa is IsaClass.AVX512_VNNI or target.has("avx512bw") else 256)


class GroupSum:
    """Exact int32 sums for `slots` accumulators of `lanes` lanes (e.g. token x row tile), with factors in one or
    two int8 halves (two: the factor is 256 * high + low, half 0 being the high one).

    zero() emits the clearing of the sums; add(slot, half, codes, factors, cmax, shift) adds codes (<= cmax)
    << shift times factors; flush() must follow the last add of a loop body (AVX2 widens its int16 partial
    sums there: they live within one unrolled run of adds); total(slot) is everything added to the slot,
    both halves combined. The sums may persist across the iterations of a loop around the adds.
    """

    def __init__(self, dot: Dot, slots: int, halves: int, lanes: int = L):
        self.dot, self.slots, self.halves, self.lanes = dot, slots, halves, lanes
        self.vnni = dot.isa is not IsaClass.AVX2
        # VNNI: one int32 accumulator per slot and half, combined at the end; AVX2: int16 partial sums per
        # (slot, half, shift), widened into one int32 sum per slot
        # one small buffer per slot and half: LLVM keeps each in a register
        self.acc = [[I.alloc_buffer((lanes,), "int32") for _ in range(slots)] for _ in range(halves if self.vnni else 1)]
        self.acc16: dict[tuple[int, int, int], object] = {}
        self.pending: dict[tuple[int, int, int], int] = {}  # key -> adds since the last widening

    def _all(self):
        return tirx.Ramp(0, 1, self.lanes)

    def zero(self) -> None:
        for bufs in self.acc:
            for buf in bufs:
                I.buffer_store(buf, _bc(0, "int32", self.lanes), [self._all()])

    def add(self, slot: int, half: int, codes, factors, cmax: int, shift: int = 0) -> None:
        at = self._all()
        if self.vnni:
            assert shift == 0, "VNNI sums full bytes"
            buf = self.acc[half][slot]
            I.buffer_store(buf, self.dot.dpbusd(buf[at], codes, factors), [at])
            return
        key = (slot, half, shift)
        if key not in self.acc16:
            self.acc16[key] = I.alloc_buffer((2 * self.lanes,), "int16")
        buf, at16 = self.acc16[key], tirx.Ramp(0, 1, 2 * self.lanes)
        n = self.pending.get(key, 0)
        p = self.dot.maddubs(codes, factors)
        I.buffer_store(buf, p if n == 0 else buf[at16] + p, [at16])
        self.pending[key] = n + 1
        if n + 1 == Dot.depth(cmax):
            self._widen(key)

    def _widen(self, key) -> None:
        slot, half, shift = key
        if not self.pending.pop(key, 0):
            return
        factor = (256 if self.halves == 2 and half == 0 else 1) << shift
        w = self.dot.maddwd(self.acc16[key][tirx.Ramp(0, 1, 2 * self.lanes)], factor)
        buf, at = self.acc[0][slot], self._all()
        I.buffer_store(buf, buf[at] + w, [at])

    def flush(self) -> None:
        for key in list(self.pending):
            self._widen(key)

    def total(self, slot: int):
        """int32x16: the slot's exact sum (after flush())."""
        assert not any(k[0] == slot for k in self.pending), "flush() before total()"
        at = self._all()
        if self.vnni and self.halves == 2:
            return (self.acc[0][slot][at] << _bc(8, "int32", self.lanes)) + self.acc[1][slot][at]
        return self.acc[0][slot][at]
