"""What a query reads from one layer's block KV cache of a given type, in float32: the numerics of kv/plan.py's
stores, for the float model of the sensitivity analysis.

Blocks older than the recent tier come from the store: K quantised per block and channel (min and scale over
the block's tokens), V per token (over the head's channels), both asymmetric with float16 parameters and
codes rounded half up, as the cache kernels write them. The recent tier (`recent` blocks, the query's own
included) and the `pinned` first blocks are read from the float16 ring. With `rotate_k`, keys are quantised
in the head's Walsh-Hadamard basis (the kernels score rotated queries against them; here the dequantised
keys are rotated back, which gives the same scores).
"""

from __future__ import annotations

import functools

import numpy as np

from ..kv.plan import KVType

F32 = np.float32


def quantise_rows(x: np.ndarray, t: KVType) -> np.ndarray:
    """Dequantised values of x [..., n] quantised along the last axis (one min and scale per row)."""
    mn = x.min(axis=-1, keepdims=True).astype(np.float16).astype(F32)
    sc = ((x.max(axis=-1, keepdims=True) - mn) / F32(t.qmax)).astype(np.float16).astype(F32)
    inv = np.where(sc > 0, F32(1) / np.where(sc > 0, sc, F32(1)), F32(0))
    codes = np.clip(np.floor((x - mn) * inv + F32(0.5)), 0, t.qmax)
    return (mn + sc * codes).astype(F32)


@functools.lru_cache(maxsize=4)
def hadamard(n: int) -> np.ndarray:
    """[n, n] orthonormal Walsh-Hadamard matrix in Sylvester order (symmetric: its own inverse). Cached: every
    store of a rotated layer uses it; callers must not write to it."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(F32)


def store_values(x: np.ndarray, side: str, t: KVType, block: int, rotate: bool = False) -> np.ndarray:
    """x [n, Hkv, hd] (n a multiple of `block`, float16-rounded) as the `t` store returns it; `rotate`:
    keys quantised in the Hadamard basis."""
    if t.is_float:
        return x
    n, H, hd = x.shape
    if side == "k":  # per block and channel: rows are channels over the block's tokens
        rot = hadamard(hd) if rotate else None
        xr = x @ rot if rotate else x
        b = xr.reshape(n // block, block, H, hd).transpose(0, 2, 3, 1)  # [nb, H, hd, block]
        out = quantise_rows(b, t).transpose(0, 3, 1, 2).reshape(n, H, hd)
        return out @ rot if rotate else out
    return quantise_rows(x, t)  # V: per token, over channels


class BlockReader:
    """A `KVRead` for the float model: keys (or values) [n, Hkv, hd] of positions 0..n-1 as queries from
    position `first` on (a run of queries within one block) read them. One reader serves one layer of one
    pass: the store's blocks are quantised once, as the context reaches them."""

    def __init__(self, side: str, t: KVType, block: int = 64, recent: int = 2, pinned: int = 0, rotate: bool = False):
        self.side, self.t, self.block, self.recent, self.pinned = side, t, block, recent, pinned
        self.rotate = rotate and side == "k"
        self._stored: np.ndarray | None = None

    def __call__(self, x: np.ndarray, first: int) -> np.ndarray:
        cut = max(first // self.block - (self.recent - 1), 0) * self.block  # older blocks: from the store
        if cut == 0 or self.t.is_float:
            return x
        have = 0 if self._stored is None else len(self._stored)
        if have < cut:  # blocks are quantised independently: only the new ones
            new = store_values(x[have:cut], self.side, self.t, self.block, self.rotate)
            self._stored = new if self._stored is None else np.concatenate([self._stored, new])
        ring = min(self.pinned * self.block, cut)  # pinned blocks: from the ring
        return np.concatenate([x[:ring], self._stored[ring:cut], x[cut:]])
