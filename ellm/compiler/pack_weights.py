"""Pack the graph's parameters from GGUF bytes: split block structs into components, concatenate fused rows."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ..quant import QuantType, pack_rows
from ..quant.requantize import requantize
from ..quant.tiled import pack_tiled
from .gguf_file import GGUFFile
from .lower import ParamSpec


class _Sources:
    """GGUF tensor bytes in the type a parameter stores them in: as the file has them, or re-quantised (the
    precision plan lowered the tensor). The last re-quantised tensors are kept: a weight's components (quants,
    scales, mins) are packed one after another from the same bytes."""

    def __init__(self, gf: GGUFFile, keep: int = 4):
        self.gf, self.keep = gf, keep
        self.cache: dict[tuple[str, QuantType], np.ndarray] = {}

    def raw(self, name: str, qtype: QuantType, row_ids: tuple[int, ...] | None = None,
            cols: tuple[int, int] | None = None) -> np.ndarray:
        """[rows, row_bytes]: all of the tensor's rows, or `row_ids` of them in that order; all columns, or the
        block-aligned range `cols`."""
        fmt = self.gf.weight_format(name)
        rows = slice(None) if row_ids is None else np.asarray(row_ids)
        # a row's blocks are consecutive: columns [c0, c1) are its bytes [c0 / block, c1 / block) * block_bytes
        byte_cols = slice(None) if cols is None else slice(*(c // fmt.block * fmt.block_bytes for c in cols))
        if fmt.qtype is qtype:
            return self.gf.raw(name)[rows, byte_cols]
        key = (name, qtype, row_ids, cols)
        if key not in self.cache:
            if len(self.cache) >= self.keep:
                del self.cache[next(iter(self.cache))]
            # row-wise and block-wise: a subset quantises alike
            self.cache[key] = requantize(self.gf.raw(name)[rows, byte_cols], fmt.qtype, qtype)
        return self.cache[key]


def pack_param(gf: GGUFFile, spec: ParamSpec, sources: _Sources | None = None) -> np.ndarray:
    """The array for one parameter, C-contiguous, with exactly `spec.shape` and `spec.dtype`."""
    if spec.values is not None:
        arr = np.asarray(spec.values, dtype=spec.dtype)
    elif spec.qtype is None:
        arr = np.concatenate([gf.vector(s) for s in spec.sources]).astype(np.float32)
    else:
        qtype = QuantType[spec.qtype]
        sources = sources or _Sources(gf)
        one = len(spec.sources) == 1
        raws = [sources.raw(s, qtype, spec.row_ids if one else None, spec.col_range) for s in spec.sources]
        raw = raws[0] if one else np.concatenate(raws)
        if spec.row_ids is not None and not one:
            raw = raw[np.asarray(spec.row_ids)]
        pack = pack_tiled if spec.layout == "tile16" else pack_rows
        arr = pack(raw, qtype)[spec.component]
    arr = np.ascontiguousarray(arr)
    if arr.shape != spec.shape or arr.dtype != np.dtype(spec.dtype):
        raise AssertionError(f"{spec.name}: packed {arr.shape} {arr.dtype}, expected {spec.shape} {spec.dtype}")
    return arr


def pack_params(gf: GGUFFile, specs: list[ParamSpec]) -> Iterator[tuple[ParamSpec, np.ndarray]]:
    """Parameters one at a time (a fused weight is packed once per component: simple, and cheap)."""
    sources = _Sources(gf)
    for spec in specs:
        yield spec, pack_param(gf, spec, sources)
