"""Pack the graph's parameters from GGUF bytes: split block structs into components, concatenate fused rows."""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ..quant import QuantType, pack_rows
from ..quant.tiled import pack_tiled
from .gguf_file import GGUFFile
from .lower import ParamSpec


def pack_param(gf: GGUFFile, spec: ParamSpec) -> np.ndarray:
    """The array for one parameter, C-contiguous, with exactly `spec.shape` and `spec.dtype`."""
    if spec.qtype is None:
        arr = np.concatenate([gf.vector(s) for s in spec.sources]).astype(np.float32)
    else:
        qtype = QuantType[spec.qtype]
        raw = np.concatenate([gf.raw(s) for s in spec.sources]) if len(spec.sources) > 1 else gf.raw(spec.sources[0])
        pack = pack_tiled if spec.layout == "tile16" else pack_rows
        arr = pack(raw, qtype)[spec.component]
    arr = np.ascontiguousarray(arr)
    if arr.shape != spec.shape or arr.dtype != np.dtype(spec.dtype):
        raise AssertionError(f"{spec.name}: packed {arr.shape} {arr.dtype}, expected {spec.shape} {spec.dtype}")
    return arr


def pack_params(gf: GGUFFile, specs: list[ParamSpec]) -> Iterator[tuple[ParamSpec, np.ndarray]]:
    """Parameters one at a time (a fused weight is packed once per component: simple, and cheap)."""
    for spec in specs:
        yield spec, pack_param(gf, spec)
