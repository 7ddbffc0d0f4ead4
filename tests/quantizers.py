"""Test-only NumPy quantizers producing GGUF block bytes (gguf.quants lacks K-quant quantizers).

Simple round-to-nearest versions of llama.cpp's formats: good enough to turn real weights into
realistic Q4_K / Q6_K blocks; dequantisation is checked against `gguf.quants.dequantize`.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as G
from gguf.quants import quant_shape_to_byte_shape
from gguf.quants import quantize as gguf_quantize


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[rows, K] float -> [rows, K/256*144] uint8."""
    rows, K = w.shape
    sb = w.reshape(rows, K // 256, 8, 32).astype(np.float32)
    lo = np.minimum(sb.min(-1), 0)  # [r, nb, 8]
    hi = sb.max(-1)
    scale = (hi - lo) / 15
    d = scale.max(-1) / 63  # [r, nb]
    dmin = (-lo).max(-1) / 63
    sd = np.where(d > 0, d, 1)[..., None]
    sm = np.where(dmin > 0, dmin, 1)[..., None]
    sc = np.clip(np.round(scale / sd), 0, 63).astype(np.uint8)
    mn = np.clip(np.round(-lo / sm), 0, 63).astype(np.uint8)
    d16, dmin16 = d.astype(np.float16).astype(np.float32), dmin.astype(np.float16).astype(np.float32)
    step = (d16[..., None] * sc)[..., None]
    off = (dmin16[..., None] * mn)[..., None]
    q = np.clip(np.round((sb + off) / np.where(step > 0, step, 1)), 0, 15).astype(np.uint8)  # [r, nb, 8, 32]
    scales = np.zeros((rows, K // 256, 12), np.uint8)
    scales[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    scales[..., 4:8] = mn[..., 0:4] | ((mn[..., 4:8] >> 4) << 6)
    scales[..., 8:12] = (sc[..., 4:8] & 0xF) | ((mn[..., 4:8] & 0xF) << 4)
    q = q.reshape(rows, K // 256, 4, 2, 32)  # chunk c: sub-blocks 2c (low nibble) and 2c+1 (high)
    qs = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(rows, K // 256, 128)
    out = np.concatenate(
        [d.astype(np.float16)[..., None].view(np.uint8), dmin.astype(np.float16)[..., None].view(np.uint8), scales, qs],
        axis=-1,
    )
    return out.reshape(rows, -1)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """[rows, K] float -> [rows, K/256*210] uint8."""
    rows, K = w.shape
    sb = w.reshape(rows, K // 256, 16, 16).astype(np.float32)
    amax = np.abs(sb).max(-1)  # [r, nb, 16]
    scale = amax / 31
    d = scale.max(-1) / 127
    sc = np.clip(np.round(scale / np.where(d > 0, d, 1)[..., None]), -128, 127).astype(np.int8)
    step = (d.astype(np.float16).astype(np.float32)[..., None] * sc)[..., None]
    q = (np.clip(np.round(sb / np.where(step != 0, step, 1)), -32, 31) + 32).astype(np.uint8)
    q = q.reshape(rows, K // 256, 2, 4, 32)  # half h, quarter r, lane l  (element 128h + 32r + l)
    ql = np.zeros((rows, K // 256, 2, 64), np.uint8)
    ql[..., 0:32] = (q[:, :, :, 0] & 0xF) | ((q[:, :, :, 2] & 0xF) << 4)
    ql[..., 32:64] = (q[:, :, :, 1] & 0xF) | ((q[:, :, :, 3] & 0xF) << 4)
    qh = (q[:, :, :, 0] >> 4) | ((q[:, :, :, 1] >> 4) << 2) | ((q[:, :, :, 2] >> 4) << 4) | ((q[:, :, :, 3] >> 4) << 6)
    out = np.concatenate(
        [ql.reshape(rows, -1, 128), qh.reshape(rows, -1, 64), sc.view(np.uint8), d.astype(np.float16)[..., None].view(np.uint8)],
        axis=-1,
    )
    return out.reshape(rows, -1)


def quantize(w: np.ndarray, qtype: int) -> np.ndarray:
    """GGUF bytes [rows, row_bytes] of float weights `w` [rows, K] in type `qtype`."""
    qtype = G(int(qtype))
    if qtype == G.Q4_K:
        return quantize_q4_k(w)
    if qtype == G.Q6_K:
        return quantize_q6_k(w)
    if qtype == G.F32:
        return np.ascontiguousarray(w, dtype=np.float32).view(np.uint8).reshape(w.shape[0], -1)
    try:
        out = gguf_quantize(np.ascontiguousarray(w, dtype=np.float32), qtype)
    except NotImplementedError:
        # A type without a quantizer here (e.g. Q5_K, which eLLM rejects): random bytes of the right size.
        shape = quant_shape_to_byte_shape(w.shape, qtype)
        return np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
    return np.ascontiguousarray(out).view(np.uint8).reshape(w.shape[0], -1)
