"""The tile16 weight layout: 16 output rows interleaved so one vector lane is one row.

A kernel loads 16 rows' weights for the same inputs with one 64-byte load, keeps per-row scales in
vector lanes and never needs a horizontal sum. Quants stay packed at their GGUF width:

* 4-bit quants (Q4_0, Q4_1, Q4_K, and Q6_K's low 4 bits): one uint32 per (row, 8 inputs); byte j holds
  input j in its low nibble and input j + 4 in its high nibble, so `w & 0x0F0F0F0F` and
  `(w >> 4) & 0x0F0F0F0F` are ready-made u8 operands of `vpdpbusd` against inputs [0..3] and [4..7].
* Q6_K's high 2 bits: one uint32 per (row, 16 inputs), placed so that a mask (and shift) moves them
  straight to bits 4-5 of the matching bytes.
* Q8_0: one uint32 per (row, 4 inputs), each stored + 128 (unsigned for `vpdpbusd`).
* scales, mins: [rows/16, groups, 16]; float weights: [rows/16, K, 16].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .formats import FORMATS, QuantType
from .pack import pack_rows

LANES = 16


@dataclass(frozen=True)
class TiledComponent:
    """A component of shape [rows/16, cols/divisor, 16]."""

    name: str
    dtype: str
    divisor: int

    def shape(self, rows: int, cols: int) -> tuple[int, int, int]:
        return (rows // LANES, cols // self.divisor, LANES)


_c = TiledComponent


TILED_COMPONENTS: dict[QuantType, tuple[TiledComponent, ...]] = {
    QuantType.F32: (_c("w", "float32", 1),),
    QuantType.F16: (_c("w", "float16", 1),),
    QuantType.BF16: (_c("w", "uint16", 1),),
    QuantType.Q8_0: (_c("qs", "uint32", 4), _c("d", "float16", 32)),
    QuantType.Q4_0: (_c("qs", "uint32", 8), _c("d", "float16", 32)),
    QuantType.Q4_1: (_c("qs", "uint32", 8), _c("d", "float16", 32), _c("m", "float16", 32)),
    QuantType.Q4_K: (
        _c("qs", "uint32", 8),
        _c("sc", "uint8", 32),
        _c("mn", "uint8", 32),
        _c("d", "float16", 256),
        _c("dmin", "float16", 256),
    ),
    QuantType.Q6_K: (_c("ql", "uint32", 8), _c("qh", "uint32", 16), _c("sc", "int8", 16), _c("d", "float16", 256)),
}


def tiled_supported(qtype: QuantType, rows: int, cols: int) -> bool:
    return rows % LANES == 0 and cols % FORMATS[qtype].block == 0 and cols % 16 == 0


def _lanes_last(a: np.ndarray) -> np.ndarray:
    """[rows, n] -> [rows/16, n, 16]."""
    rows, n = a.shape
    return np.ascontiguousarray(a.reshape(rows // LANES, LANES, n).transpose(0, 2, 1))


def unpack_quants(raw: np.ndarray, qtype: QuantType) -> np.ndarray:
    """The integer quant of every weight, [rows, cols] uint8 in column order (Q8_0: int8)."""
    comp = pack_rows(raw, qtype)
    rows = raw.shape[0]
    if qtype is QuantType.Q8_0:
        return comp["qs"]
    if qtype in (QuantType.Q4_0, QuantType.Q4_1):
        qs = comp["qs"].reshape(rows, -1, 16)  # [rows, blocks, 16]: byte i = inputs i (low), i + 16 (high)
        return np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(rows, -1)
    if qtype is QuantType.Q4_K:
        qs = comp["qs"].reshape(rows, -1, 32)  # [rows, 64-input chunks, 32]: low = inputs l, high = 32 + l
        return np.concatenate([qs & 0xF, qs >> 4], axis=-1).reshape(rows, -1)
    if qtype is QuantType.Q6_K:
        ql = comp["ql"].reshape(rows, -1, 2, 64)  # [rows, super-blocks, halves, 64]
        qh = comp["qh"].reshape(rows, -1, 2, 32)
        lo = np.stack([ql[..., 0:32] & 0xF, ql[..., 32:64] & 0xF, ql[..., 0:32] >> 4, ql[..., 32:64] >> 4], axis=-2)
        hi = np.stack([(qh >> (2 * r)) & 3 for r in range(4)], axis=-2)  # [rows, sb, 2, 4 quarters, 32]
        return (lo | (hi << 4)).reshape(rows, -1)
    raise ValueError(qtype)


def _nibble_words(q: np.ndarray) -> np.ndarray:
    """[rows, cols] values < 16 -> [rows/16, cols/8, 16] uint32 (byte j: input j low, input j + 4 high)."""
    rows, cols = q.shape
    q8 = q.reshape(rows, cols // 8, 8).astype(np.uint32)
    b = q8[..., 0:4] | (q8[..., 4:8] << 4)  # [rows, octets, 4 bytes]
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return _lanes_last(words)


def _q6_high_words(h: np.ndarray) -> np.ndarray:
    """[rows, cols] 2-bit values -> [rows/16, cols/16, 16] uint32.

    Octet 2p (inputs 16p..16p+7): input j at bits 8j+4, input j+4 at bits 8j+6; octet 2p+1: at 8j+0, 8j+2.
    """
    rows, cols = h.shape
    h = h.reshape(rows, cols // 16, 2, 2, 4).astype(np.uint32)  # [rows, pairs, octet, half, j]
    shifts = np.array([[4, 6], [0, 2]], np.uint32)[None, None, :, :, None] + 8 * np.arange(4, dtype=np.uint32)
    words = (h << shifts).sum(axis=(2, 3, 4), dtype=np.uint64).astype(np.uint32)
    return _lanes_last(words)


def pack_tiled(raw: np.ndarray, qtype: QuantType) -> dict[str, np.ndarray]:
    """GGUF tensor bytes [rows, row_bytes] -> {component: [rows/16, n, 16] array} in the tile16 layout."""
    comp = pack_rows(raw, qtype)
    if qtype in (QuantType.F32, QuantType.F16, QuantType.BF16):
        return {"w": _lanes_last(comp["w"])}
    q = unpack_quants(raw, qtype)
    if qtype is QuantType.Q8_0:
        u = (q.astype(np.int16) + 128).astype(np.uint32).reshape(q.shape[0], -1, 4)
        words = u[..., 0] | (u[..., 1] << 8) | (u[..., 2] << 16) | (u[..., 3] << 24)
        return {"qs": _lanes_last(words), "d": _lanes_last(comp["d"])}
    if qtype is QuantType.Q6_K:
        return {
            "ql": _nibble_words(q & 0xF),
            "qh": _q6_high_words(q >> 4),
            "sc": _lanes_last(comp["sc"]),
            "d": _lanes_last(comp["d"]),
        }
    out = {"qs": _nibble_words(q)}
    for name in ("sc", "mn", "d", "dmin", "m"):
        if name in comp:
            out[name] = _lanes_last(comp[name])
    return out
