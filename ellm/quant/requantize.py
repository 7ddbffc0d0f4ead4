"""Quantise float weights to GGUF block bytes, so a precision plan can store a tensor below its source type.

Q8_0, Q4_0 and Q4_1 follow `gguf.quants` (itself bit-exact with llama.cpp's reference quantisers) operation
for operation, in float32: the tests require identical bytes. gguf does not quantise the K types; Q4_K and
Q6_K follow llama.cpp's reference algorithms (`quantize_row_q4_K_ref`: a weighted least-squares scale and
min search per 32 weights; `quantize_row_q6_K_ref`: an RMSE-weighted scale search per 16 weights), here
vectorised over all blocks at once. Their sums run in NumPy's order, not C's, so a last-bit difference in a
scale can move a code; the tests bound their errors instead.
"""

from __future__ import annotations

import numpy as np

from ..errors import EllmError
from .formats import FORMATS, QuantType

F32 = np.float32
GROUP_MAX_EPS = F32(1e-15)
# the types a weight can be lowered to, most precise first
TARGET_TYPES = (QuantType.F16, QuantType.Q8_0, QuantType.Q6_K, QuantType.Q4_1, QuantType.Q4_K, QuantType.Q4_0)


def _round_away(x: np.ndarray) -> np.ndarray:
    """Round half away from zero (C's roundf), as gguf's `np_roundf` computes it."""
    a = np.abs(x)
    f = np.floor(a)
    return np.sign(x) * (f + np.floor(2 * (a - f)))


def _inv(d: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(d == 0, F32(0), F32(1) / d).astype(F32)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    """[..., 1] float32 -> [..., 2] uint8 (float16, little-endian)."""
    return x.astype(np.float16).view(np.uint8)


def _q8_0(b: np.ndarray) -> np.ndarray:
    # b: [n, 32]
    d = np.abs(b).max(axis=1, keepdims=True) / F32(127)
    qs = _round_away(b * _inv(d)).astype(np.int8).view(np.uint8)
    return np.concatenate([_f16_bytes(d), qs], axis=1)


def _nibbles(q: np.ndarray) -> np.ndarray:
    """[n, 32] codes 0..15 -> [n, 16] bytes: element i in the low nibble, i + 16 in the high one."""
    return q[:, :16] | (q[:, 16:] << np.uint8(4))


def _q4_0(b: np.ndarray) -> np.ndarray:
    imax = np.abs(b).argmax(axis=1)[:, None]
    d = np.take_along_axis(b, imax, axis=1) / F32(-8)
    q = np.trunc(b * _inv(d) + F32(8.5)).astype(np.uint8).clip(0, 15)
    return np.concatenate([_f16_bytes(d), _nibbles(q)], axis=1)


def _q4_1(b: np.ndarray) -> np.ndarray:
    hi, lo = b.max(axis=1, keepdims=True), b.min(axis=1, keepdims=True)
    d = (hi - lo) / F32(15)
    q = np.trunc((b - lo) * _inv(d) + F32(0.5)).astype(np.uint8).clip(0, 15)
    return np.concatenate([_f16_bytes(d), _f16_bytes(lo), _nibbles(q)], axis=1)


def _nearest(x: np.ndarray) -> np.ndarray:
    """llama.cpp's `nearest_int`: round half to even."""
    return np.rint(x).astype(np.int32)


def _make_qkx2(x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """Scale and min of each row of x [n, k] for codes 0..nmax minimising the w-weighted squared error
    (`make_qkx2_quants`, use_mad false). Returns (scale [n], min >= 0 to subtract [n], codes [n, k])."""
    lo = np.minimum(x.min(axis=1), F32(0))
    hi = x.max(axis=1)
    span = hi - lo
    flat = span == 0
    span = np.where(flat, F32(1), span)
    sum_w, sum_x = w.sum(axis=1), (w * x).sum(axis=1)
    iscale = F32(nmax) / span
    scale = F32(1) / iscale
    L = np.clip(_nearest(iscale[:, None] * (x - lo[:, None])), 0, nmax)
    best = (w * (scale[:, None] * L + lo[:, None] - x) ** 2).sum(axis=1)
    mn = lo.copy()
    for i in range(nstep + 1):
        iscale = (F32(rmin) + F32(rdelta) * F32(i) + F32(nmax)) / span
        La = np.clip(_nearest(iscale[:, None] * (x - lo[:, None])), 0, nmax).astype(F32)
        sl, sl2, sxl = (w * La).sum(axis=1), (w * La * La).sum(axis=1), (w * La * x).sum(axis=1)
        D = sum_w * sl2 - sl * sl
        ok = D > 0
        Ds = np.where(ok, D, F32(1))
        s = (sum_w * sxl - sum_x * sl) / Ds
        m = (sl2 * sum_x - sl * sxl) / Ds
        pos = m > 0
        m = np.where(pos, F32(0), m)
        s = np.where(pos, sxl / np.where(sl2 > 0, sl2, F32(1)), s)
        err = (w * (s[:, None] * La + m[:, None] - x) ** 2).sum(axis=1)
        take = ok & (err < best)
        L = np.where(take[:, None], La.astype(np.int32), L)
        best, scale, mn = np.where(take, err, best), np.where(take, s, scale), np.where(take, m, mn)
    scale = np.where(flat, F32(0), scale)
    L = np.where(flat[:, None], 0, L)
    return scale.astype(F32), (-mn).astype(F32), L


def _q4_k(x: np.ndarray) -> np.ndarray:
    # x: [n, 256] -> [n, 144]: d, dmin (f16), 12 bytes of 6-bit scales and mins, 128 bytes of nibbles
    n = x.shape[0]
    sub = x.reshape(n * 8, 32)
    av = np.sqrt((sub * sub).sum(axis=1) / F32(32))
    scales, mins, L = _make_qkx2(sub, av[:, None] + np.abs(sub), 15, -1.0, 0.1, 20)
    scales, mins, L = scales.reshape(n, 8), mins.reshape(n, 8), L.reshape(n, 8, 32)
    max_scale, max_min = scales.max(axis=1), mins.max(axis=1)
    max_scale, max_min = np.maximum(max_scale, F32(0)), np.maximum(max_min, F32(0))
    inv_s = np.where(max_scale > 0, F32(63) / np.where(max_scale > 0, max_scale, F32(1)), F32(0))
    inv_m = np.where(max_min > 0, F32(63) / np.where(max_min > 0, max_min, F32(1)), F32(0))
    ls = np.clip(_nearest(inv_s[:, None] * scales), 0, 63).astype(np.uint8)  # [n, 8]
    lm = np.clip(_nearest(inv_m[:, None] * mins), 0, 63).astype(np.uint8)
    d16 = (max_scale / F32(63)).astype(np.float16)
    dmin16 = (max_min / F32(63)).astype(np.float16)
    d = d16.astype(F32)[:, None] * ls  # [n, 8]
    dm = dmin16.astype(F32)[:, None] * lm
    safe = np.where(d != 0, d, F32(1))
    Lq = np.clip(_nearest((x.reshape(n, 8, 32) + dm[..., None]) / safe[..., None]), 0, 15)
    L = np.where((d != 0)[..., None], Lq, L).astype(np.uint8)  # a zero scale keeps the search's codes
    packed = np.zeros((n, 12), np.uint8)
    packed[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    packed[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    packed[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    L = L.reshape(n, 4, 2, 32)  # 64-element chunk c: sub-blocks 2c (low nibbles) and 2c + 1 (high)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([d16[:, None].view(np.uint8), dmin16[:, None].view(np.uint8), packed, qs], axis=1)


def _make_qx(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Signed scale of each row of x [n, k] for codes -nmax..nmax-1 (`make_qx_quants`, rmse_type 1: weights
    x^2). Returns (scale [n], codes + nmax [n, k])."""
    ax = np.abs(x)
    imax = ax.argmax(axis=1)[:, None]
    amax = np.take_along_axis(ax, imax, axis=1)[:, 0]
    mx = np.take_along_axis(x, imax, axis=1)[:, 0]
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, F32(1), mx)
    w = x * x

    def codes(iscale):
        return np.clip(_nearest(iscale[:, None] * x), -nmax, nmax - 1)

    iscale = F32(-nmax) / mx
    l = codes(iscale)
    lf = l.astype(F32)
    sumlx, suml2 = (w * x * lf).sum(axis=1), (w * lf * lf).sum(axis=1)
    scale = np.where(suml2 != 0, sumlx / np.where(suml2 != 0, suml2, F32(1)), F32(0))
    best = scale * sumlx
    L = l
    for i in (*range(-9, 0), *range(1, 10)):
        iscale = -(F32(nmax) + F32(0.1) * F32(i)) / mx
        li = codes(iscale)
        lf = li.astype(F32)
        sumlx, suml2 = (w * x * lf).sum(axis=1), (w * lf * lf).sum(axis=1)
        take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
        s = sumlx / np.where(suml2 > 0, suml2, F32(1))
        L = np.where(take[:, None], li, L)
        scale, best = np.where(take, s, scale), np.where(take, s * sumlx, best)
    scale = np.where(zero, F32(0), scale)
    L = np.where(zero[:, None], 0, L + nmax)
    return scale.astype(F32), L


def _q6_k(x: np.ndarray) -> np.ndarray:
    # x: [n, 256] -> [n, 210]: ql (128), qh (64), 16 int8 scales, d (f16)
    n = x.shape[0]
    scales, L = _make_qx(x.reshape(n * 16, 16), 32)
    scales, L = scales.reshape(n, 16), L.reshape(n, 16, 16)
    imax = np.abs(scales).argmax(axis=1)[:, None]
    max_scale = np.take_along_axis(scales, imax, axis=1)[:, 0]
    empty = np.abs(max_scale) < GROUP_MAX_EPS
    iscale = F32(-128) / np.where(empty, F32(1), max_scale)
    d16 = np.where(empty, F32(0), F32(1) / iscale).astype(np.float16)
    sc = np.minimum(127, _nearest(iscale[:, None] * scales)).astype(np.int8)  # [n, 16]
    d = d16.astype(F32)[:, None] * sc
    safe = np.where(d != 0, d, F32(1))
    Lq = np.clip(_nearest(x.reshape(n, 16, 16) / safe[..., None]), -32, 31) + 32
    L = np.where((d != 0)[..., None], Lq, L).astype(np.uint8)
    L = np.where(empty[:, None, None], 0, L).astype(np.uint8).reshape(n, 2, 4, 32)  # half, quarter, lane
    ql = np.concatenate([(L[:, :, 0] & 0xF) | ((L[:, :, 2] & 0xF) << 4),
                         (L[:, :, 1] & 0xF) | ((L[:, :, 3] & 0xF) << 4)], axis=2)  # [n, 2, 64]
    qh = (L[:, :, 0] >> 4) | ((L[:, :, 1] >> 4) << 2) | ((L[:, :, 2] >> 4) << 4) | ((L[:, :, 3] >> 4) << 6)
    sc = np.where(empty[:, None], 0, sc).astype(np.int8)
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), d16[:, None].view(np.uint8)], axis=1)


_BLOCK_QUANTISERS = {QuantType.Q8_0: _q8_0, QuantType.Q4_0: _q4_0, QuantType.Q4_1: _q4_1,
                     QuantType.Q4_K: _q4_k, QuantType.Q6_K: _q6_k}


def quantize(w: np.ndarray, qtype: QuantType, chunk_rows: int = 4096) -> np.ndarray:
    """Float weights [rows, K] -> GGUF bytes [rows, row_bytes] of `qtype` (row by row, in bounded memory)."""
    qtype = QuantType(qtype)
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"quantize wants [rows, K], got shape {w.shape}")
    rows, K = w.shape
    if qtype is QuantType.F32:
        return np.ascontiguousarray(w, dtype=F32).view(np.uint8).reshape(rows, -1)
    if qtype is QuantType.F16:
        return np.ascontiguousarray(w.astype(np.float16)).view(np.uint8).reshape(rows, -1)
    if qtype not in _BLOCK_QUANTISERS:
        raise EllmError(f"cannot quantise to {qtype.name} (supported: F32, F16, {', '.join(q.name for q in _BLOCK_QUANTISERS)})")
    fmt = FORMATS[qtype]
    fmt.check_cols(K)
    out = np.empty((rows, fmt.row_bytes(K)), np.uint8)
    for r in range(0, rows, chunk_rows):
        part = np.ascontiguousarray(w[r : r + chunk_rows], dtype=F32)
        blocks = part.reshape(-1, fmt.block)
        out[r : r + chunk_rows] = _BLOCK_QUANTISERS[qtype](blocks).reshape(part.shape[0], -1)
    return out


def dequantize(raw: np.ndarray, qtype: QuantType) -> np.ndarray:
    """GGUF bytes [rows, row_bytes] -> float32 [rows, K] (gguf's dequantisers)."""
    from gguf.quants import dequantize as gguf_dequantize

    return np.asarray(gguf_dequantize(np.asarray(raw), int(qtype)), dtype=F32)


def requantize(raw: np.ndarray, src: QuantType, dst: QuantType) -> np.ndarray:
    """A tensor's GGUF bytes in `src` -> its bytes in `dst`, through float32 (`raw` itself when they agree)."""
    if QuantType(src) is QuantType(dst):
        return raw
    return quantize(dequantize(raw, src), dst)
