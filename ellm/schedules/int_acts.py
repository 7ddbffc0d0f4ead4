"""Activations of the integer kernels: each token's row quantised per 32 inputs inside the kernel.

8-bit: q = round(x / dx) with dx = max |x| / 127 over the group (llama.cpp's Q8). 16-bit: |q| <= 32639,
split as q = 256 xq + xl with both halves in [-128, 127], so two int8 dot products give the 16-bit one
(relative error 1/65278 of a group's largest value instead of 1/254). Every half is a valid int8
factor of every dot-product class in schedules/intdot.py (|f| <= 128).
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.tirx.script.builder import ir as I

from .vecmath import hmax, hsum

L = 16
F32, I32 = "float32x16", "int32x16"


def ramp(base, n=L):
    return tirx.Ramp(base, 1, n)


def splat(v, dtype: str):
    return tirx.Broadcast(tirx.const(v, dtype.split("x")[0]), L) if isinstance(v, (int, float)) else tirx.Broadcast(v, L)


@dataclass(frozen=True)
class Acts:
    """Quantised activations of a kernel: xq (int8, 16-bit: high bytes), xl (16-bit: low bytes, else None),
    dx (scale per 32 inputs), and dx times the sum of the quantised values per 16 and per 32 inputs (ds16,
    ds32: for the offset and minimum terms of the weight formats, computed once per token rather than once
    per row tile). All are [tokens, ...]."""

    xq: object
    xl: object
    dx: object
    ds16: object
    ds32: object

    @classmethod
    def alloc(cls, n_tok, K: int, bits: int) -> Acts:
        return cls(
            I.alloc_buffer((n_tok, K), "int8"),
            I.alloc_buffer((n_tok, K), "int8") if bits == 16 else None,
            I.alloc_buffer((n_tok, K // 32), "float32"),
            I.alloc_buffer((n_tok, K // 16), "float32"),
            I.alloc_buffer((n_tok, K // 32), "float32"),
        )

    def ds(self, t, g, G: int):
        """dx * (sum of the quantised values) of token t over input group g of G (16 or 32) inputs."""
        return self.ds32[t, g] if G == 32 else self.ds16[t, g]

    @property
    def halves(self) -> list:
        """The int8 factor arrays, high half first."""
        return [self.xq] + ([self.xl] if self.xl is not None else [])


def quantize_group(vs, t, b, acts: Acts) -> None:
    """Quantise 32 values (two 16-lane vectors) as group b of token t (see the module docstring)."""
    xl = acts.xl
    qmax = tirx.const(127.0 if xl is None else 32639.0, "float32")
    amax = I.Bind(hmax(tirx.max(tirx.abs(vs[0]), tirx.abs(vs[1]))))
    inv = I.Bind(tirx.Select(amax > tirx.const(0.0, "float32"), qmax / amax, tirx.const(0.0, "float32")))
    dx = I.Bind(amax / qmax)
    I.buffer_store(acts.dx, dx, [t, b])
    sums = []
    for h in range(2):
        q = I.Bind(tirx.Cast(I32, tirx.round(vs[h] * splat(inv, F32))))
        cols = ramp(b * 32 + h * L)
        if xl is None:
            I.buffer_store(acts.xq, tirx.Cast("int8x16", q), [t, cols])
        else:
            lo = I.Bind(((q + splat(128, I32)) & splat(255, I32)) - splat(128, I32))
            I.buffer_store(xl, tirx.Cast("int8x16", lo), [t, cols])
            I.buffer_store(acts.xq, tirx.Cast("int8x16", (q - lo) >> splat(8, I32)), [t, cols])
        sums.append(I.Bind(hsum(q)))
        I.buffer_store(acts.ds16, dx * tirx.Cast("float32", sums[h]), [t, b * 2 + h])
    I.buffer_store(acts.ds32, dx * tirx.Cast("float32", sums[0] + sums[1]), [t, b])


def quantize_row(x, src_row, gain, eps: float, K: int, acts: Acts, t) -> None:
    """Token t's activations from x[src_row] (times rstd * gain when RMSNorm is fused), per 32 inputs."""
    scale = None
    if gain is not None:
        ss = I.alloc_buffer((L,), "float32")
        I.buffer_store(ss, splat(0.0, F32), [ramp(0)])
        with I.serial(0, K // L) as c:
            v = x[src_row, ramp(c * L)]
            I.buffer_store(ss, ss[ramp(0)] + v * v, [ramp(0)])
        scale = I.Bind(tirx.const(1.0, "float32") / tirx.sqrt(hsum(ss[ramp(0)]) / tirx.const(float(K), "float32") + tirx.const(eps, "float32")))
    with I.serial(0, K // 32) as b:
        vs = []
        for h in range(2):
            v = x[src_row, ramp(b * 32 + h * L)]
            if gain is not None:
                v = v * splat(scale, F32) * gain[ramp(b * 32 + h * L)]
            vs.append(I.Bind(v))
        quantize_group(vs, t, b, acts)
