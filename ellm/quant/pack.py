"""Split GGUF block structs into the component arrays of a `WeightFormat` (lossless, vectorised NumPy)."""

from __future__ import annotations

import numpy as np

from .formats import FORMATS, QuantType, WeightFormat


def _blocks(raw: np.ndarray, fmt: WeightFormat) -> np.ndarray:
    """[rows, row_bytes] uint8 -> [rows, n_blocks, block_bytes]."""
    rows = raw.shape[0]
    return raw.reshape(rows, -1, fmt.block_bytes)


def _field(b: np.ndarray, start: int, stop: int, dtype) -> np.ndarray:
    """Bytes [start, stop) of every block, viewed as `dtype`, flattened per row."""
    rows = b.shape[0]
    return np.ascontiguousarray(b[:, :, start:stop]).view(dtype).reshape(rows, -1)


def _unpack_q4k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 packed bytes per super-block -> 8 six-bit scales and 8 six-bit mins (`get_scale_min_k4`)."""
    # s: [rows, n_blocks, 12]
    d, m, md = s[..., 0:4], s[..., 4:8], s[..., 8:12]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    rows = s.shape[0]
    return sc.reshape(rows, -1).astype(np.uint8), mn.reshape(rows, -1).astype(np.uint8)


def pack_rows(raw: np.ndarray, qtype: QuantType) -> dict[str, np.ndarray]:
    """GGUF tensor bytes [rows, row_bytes] (uint8) -> {component name: [rows, n] array}."""
    fmt = FORMATS[qtype]
    raw = np.asarray(raw).view(np.uint8)
    rows = raw.shape[0]
    if qtype is QuantType.F32:
        return {"w": np.ascontiguousarray(raw).view(np.float32).reshape(rows, -1)}
    if qtype is QuantType.F16:
        return {"w": np.ascontiguousarray(raw).view(np.float16).reshape(rows, -1)}
    if qtype is QuantType.BF16:
        return {"w": np.ascontiguousarray(raw).view(np.uint16).reshape(rows, -1)}
    b = _blocks(raw, fmt)
    if qtype is QuantType.Q8_0:
        return {"qs": _field(b, 2, 34, np.int8), "d": _field(b, 0, 2, np.float16)}
    if qtype is QuantType.Q4_0:
        return {"qs": _field(b, 2, 18, np.uint8), "d": _field(b, 0, 2, np.float16)}
    if qtype is QuantType.Q4_1:
        return {"qs": _field(b, 4, 20, np.uint8), "d": _field(b, 0, 2, np.float16), "m": _field(b, 2, 4, np.float16)}
    if qtype is QuantType.Q4_K:
        sc, mn = _unpack_q4k_scales(b[:, :, 4:16])
        return {
            "qs": _field(b, 16, 144, np.uint8),
            "sc": sc,
            "mn": mn,
            "d": _field(b, 0, 2, np.float16),
            "dmin": _field(b, 2, 4, np.float16),
        }
    if qtype is QuantType.Q6_K:
        return {
            "ql": _field(b, 0, 128, np.uint8),
            "qh": _field(b, 128, 192, np.uint8),
            "sc": _field(b, 192, 208, np.int8),
            "d": _field(b, 208, 210, np.float16),
        }
    raise AssertionError(qtype)


def packed_nbytes(qtype: QuantType, rows: int, cols: int) -> int:
    """Bytes of all components of a [rows, cols] weight (before alignment padding)."""
    fmt = FORMATS[qtype]
    total = 0
    for c in fmt.components:
        r, n = fmt.component_shape(c, rows, cols)
        total += r * n * np.dtype(c.dtype).itemsize
    return total
