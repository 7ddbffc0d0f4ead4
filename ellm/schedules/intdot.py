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


@dataclass(frozen=True)
class Dot:
    """The dot-product instructions of one ISA class (`width`: register bits they run on)."""

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
        """acc (int32x16) + the 4-byte lane dots of a (codes, int8x64 holding u8) and b (int8x64): VNNI only."""
        if self.isa is IsaClass.AVX512_VNNI:
            return tirx.call_llvm_pure_intrin(I32, "llvm.x86.avx512.vpdpbusd.512", acc, a_u8, b_s8)
        assert self.isa is IsaClass.AVX_VNNI, self.isa
        (a0, a1), (b0, b1), (c0, c1) = _halves(a_u8, 64), _halves(b_s8, 64), _halves(acc, L)
        r = [tirx.call_llvm_pure_intrin("int32x8", "llvm.x86.avx512.vpdpbusd.256", c, a, b)
             for c, a, b in ((c0, a0, b0), (c1, a1, b1))]
        return _concat(r[0], r[1], L)

    def maddubs(self, a_u8, b_s8):
        """int16x32: sums of adjacent u8 x s8 products (saturating; see the module's bounds)."""
        if self.width == 512:
            return tirx.call_llvm_pure_intrin(I16, "llvm.x86.avx512.pmaddubs.w.512", a_u8, b_s8)
        (a0, a1), (b0, b1) = _halves(a_u8, 64), _halves(b_s8, 64)
        r = [tirx.call_llvm_pure_intrin("int16x16", "llvm.x86.avx2.pmadd.ub.sw", a, b) for a, b in ((a0, b0), (a1, b1))]
        return _concat(r[0], r[1], 2 * L)

    def maddwd(self, p16, factor: int):
        """int32x16: adjacent int16 pairs of p16, each times `factor`, summed."""
        f = _bc(factor, "int16", 2 * L)
        if self.width == 512:
            return tirx.call_llvm_pure_intrin(I32, "llvm.x86.avx512.pmaddw.d.512", p16, f)
        (p0, p1), (f0, f1) = _halves(p16, 2 * L), _halves(f, 2 * L)
        r = [tirx.call_llvm_pure_intrin("int32x8", "llvm.x86.avx2.pmadd.wd", p, q) for p, q in ((p0, f0), (p1, f1))]
        return _concat(r[0], r[1], L)

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
    """Exact int32 sums for `slots` accumulators of 16 lanes (e.g. token x row tile), with factors in one or two
    int8 halves (two: the factor is 256 * high + low, half 0 being the high one).

    zero() emits the clearing of the sums; add(slot, half, codes, factors, cmax, shift) adds codes (<= cmax)
    << shift times factors; flush() must follow the last add of a loop body (AVX2 widens its int16 partial
    sums there: they live within one unrolled run of adds); total(slot) is everything added to the slot,
    both halves combined. The sums may persist across the iterations of a loop around the adds.
    """

    def __init__(self, dot: Dot, slots: int, halves: int):
        self.dot, self.slots, self.halves = dot, slots, halves
        self.vnni = dot.isa is not IsaClass.AVX2
        # VNNI: one int32 accumulator per slot and half, combined at the end; AVX2: int16 partial sums per
        # (slot, half, shift), widened into one int32 sum per slot
        self.acc = [I.alloc_buffer((slots * L,), "int32") for _ in range(halves if self.vnni else 1)]
        self.acc16: dict[tuple[int, int, int], object] = {}
        self.pending: dict[tuple[int, int, int], int] = {}  # key -> adds since the last widening

    def zero(self) -> None:
        for buf in self.acc:
            for s in range(self.slots):
                I.buffer_store(buf, _bc(0, "int32", L), [tirx.Ramp(s * L, 1, L)])

    def add(self, slot: int, half: int, codes, factors, cmax: int, shift: int = 0) -> None:
        at = tirx.Ramp(slot * L, 1, L)
        if self.vnni:
            assert shift == 0, "VNNI sums full bytes"
            buf = self.acc[half]
            I.buffer_store(buf, self.dot.dpbusd(buf[at], codes, factors), [at])
            return
        key = (slot, half, shift)
        if key not in self.acc16:
            self.acc16[key] = I.alloc_buffer((2 * L,), "int16")
        buf, at16 = self.acc16[key], tirx.Ramp(0, 1, 2 * L)
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
        w = self.dot.maddwd(self.acc16[key][tirx.Ramp(0, 1, 2 * L)], factor)
        at = tirx.Ramp(slot * L, 1, L)
        I.buffer_store(self.acc[0], self.acc[0][at] + w, [at])

    def flush(self) -> None:
        for key in list(self.pending):
            self._widen(key)

    def total(self, slot: int):
        """int32x16: the slot's exact sum (after flush())."""
        assert not any(k[0] == slot for k in self.pending), "flush() before total()"
        at = tirx.Ramp(slot * L, 1, L)
        if self.vnni and self.halves == 2:
            return (self.acc[0][at] << _bc(8, "int32", L)) + self.acc[1][at]
        return self.acc[0][at]
