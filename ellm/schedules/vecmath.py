"""Vectorisable float32 math as TIR expressions (LLVM scalarises `llvm.exp` into libm calls; these stay in registers)."""

from __future__ import annotations

import tvm
from tvm import te, tirx

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693359375  # ln 2 split in two so n * _LN2_HI is exact (Cody-Waite)
_LN2_LO = -2.12194440e-4
# Minimax polynomial for exp(r) on |r| <= ln2/2 (Cephes expf), relative error < 2 ulp.
_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1)


def _expr(x) -> tirx.PrimExpr:
    return x.asobject() if isinstance(x, te.tensor.TensorSlice) else x


def lanes(x) -> int:
    return tvm.DataType(str(_expr(x).ty.dtype)).lanes


def splat(v, dtype: str, n: int) -> tirx.PrimExpr:
    """Constant `v` of `dtype`, broadcast to `n` lanes when n > 1."""
    c = tirx.const(v, dtype)
    return tirx.Broadcast(c, n) if n > 1 else c


def _const(v: float, like) -> tirx.PrimExpr:
    return splat(v, "float32", lanes(like))


def exp_f32(x: tirx.PrimExpr) -> tirx.PrimExpr:
    """e**x for float32 scalars or vectors, within 2 ulp; below -87.3 it is 0 and above 88.3 it saturates."""
    x = _expr(x)
    n_lanes = lanes(x)
    i32 = "int32" if n_lanes == 1 else f"int32x{n_lanes}"
    f32 = "float32" if n_lanes == 1 else f"float32x{n_lanes}"
    underflow = x < _const(-87.3365478515625, x)
    x = tirx.max(tirx.min(x, _const(88.3762626647949, x)), _const(-87.3365478515625, x))
    n = tirx.floor(x * _const(_LOG2E, x) + _const(0.5, x))
    r = x - n * _const(_LN2_HI, x) - n * _const(_LN2_LO, x)
    p = _const(_P[0], x)
    for c in _P[1:]:
        p = p * r + _const(c, x)
    p = p * r * r + r + _const(1.0, x)
    # 2**n by building the float's exponent field.
    scale = tirx.reinterpret(f32, (tirx.Cast(i32, n) + splat(127, "int32", n_lanes)) << splat(23, "int32", n_lanes))
    return tirx.Select(underflow, _const(0.0, x), p * scale)


def hreduce(v: tirx.PrimExpr, combine) -> tirx.PrimExpr:
    """Combine a vector's lanes pairwise by halving: log2(lanes) shuffles and `combine` steps."""
    v = _expr(v)
    n = lanes(v)
    while n > 1:
        half = n // 2
        v = combine(tirx.Shuffle([v], list(range(half))), tirx.Shuffle([v], list(range(half, n))))
        n = half
    return v


def hsum(v: tirx.PrimExpr) -> tirx.PrimExpr:
    """Sum of a vector's lanes."""
    return hreduce(v, lambda a, b: a + b)


def hmax(v: tirx.PrimExpr) -> tirx.PrimExpr:
    """Largest lane of a vector."""
    return hreduce(v, tirx.max)


def sigmoid_f32(x: tirx.PrimExpr) -> tirx.PrimExpr:
    x = _expr(x)
    return _const(1.0, x) / (_const(1.0, x) + exp_f32(-x))


def hadamard(vecs: list, scale: float | None = None) -> list:
    """The orthonormal Walsh-Hadamard transform (Sylvester order, symmetric: its own inverse) of the
    n = len(vecs) * lanes values held in float32 vectors `vecs`, as vector expressions: log2(n) butterfly
    stages, across vectors for strides >= lanes, by lane shuffles within a vector below. `scale` defaults to
    1/sqrt(n)."""
    vecs = [_expr(v) for v in vecs]
    w = lanes(vecs[0])
    n = w * len(vecs)
    if n & (n - 1) or len(vecs) & (len(vecs) - 1):
        raise ValueError(f"a Hadamard transform needs a power-of-two length, got {len(vecs)} x {w}")
    s = 1
    while s < w:  # within a vector: lane i pairs with lane i ^ s (x_lo + x_hi, x_lo - x_hi)
        sign = tirx.Shuffle([tirx.Broadcast(tirx.const(1.0, "float32"), w), tirx.Broadcast(tirx.const(-1.0, "float32"), w)],
                            [w * ((i & s) != 0) + i for i in range(w)])
        vecs = [tirx.Shuffle([v], [i ^ s for i in range(w)]) + sign * v for v in vecs]
        s *= 2
    step = 1
    while step < len(vecs):  # across vectors: vector j pairs with vector j ^ step
        vecs = [vecs[j] + vecs[j ^ step] if not j & step else vecs[j ^ step] - vecs[j] for j in range(len(vecs))]
        step *= 2
    k = _const(scale if scale is not None else n ** -0.5, vecs[0])
    return [v * k for v in vecs]
