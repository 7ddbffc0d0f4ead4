"""The GGUF tensor table, checked before any tensor byte is trusted: sizes computed exactly (Python integers, so
dimensions whose product overflows int64 are caught rather than wrapped), every tensor's data aligned, inside
the file and overlapping no other tensor's."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..errors import GGUFError
from .gguf_header import Header

# A dimension past this is no model's: it bounds the arithmetic below and names the tensor that is wrong.
MAX_DIM = 1 << 40


@dataclass(frozen=True)
class TensorInfo:
    """A GGUF tensor in matrix terms: `rows` outputs of `cols` inputs (ggml's ne1, ne0)."""

    name: str
    type_id: int
    rows: int
    cols: int
    ndim: int
    offset: int  # absolute file offset of the data
    nbytes: int


def tensor_bytes(path: Path, name: str, dims: list[int], type_id: int) -> int:
    """Bytes of a tensor of `dims` (ggml order) and type, exactly; the row length must be whole blocks."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    try:
        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(type_id)]
    except (ValueError, KeyError):
        raise GGUFError(f"{path}: tensor {name} has unknown type {type_id}") from None
    if not dims or any(d < 1 or d > MAX_DIM for d in dims):
        raise GGUFError(f"{path}: tensor {name} has dimensions {dims} (each must be 1 .. 2^40)")
    if dims[0] % block:
        raise GGUFError(f"{path}: tensor {name}: rows of {dims[0]} values are not whole blocks of {block}")
    return math.prod(dims) // block * type_size  # Python integers: exact


def check_table(path: Path, header: Header, file_size: int) -> dict[str, TensorInfo]:
    """The header's tensors as TensorInfo, each checked: exact size, alignment, bounds, no overlap."""
    out: dict[str, TensorInfo] = {}
    for t in header.tensors:
        nbytes = tensor_bytes(path, t.name, list(t.dims), t.type_id)
        if nbytes >= 1 << 63:
            raise GGUFError(f"{path}: tensor {t.name}: dimensions {list(t.dims)} overflow 64-bit sizes")
        if t.offset % header.alignment:
            raise GGUFError(f"{path}: tensor {t.name}'s data at {t.offset} is not aligned to {header.alignment} bytes")
        offset = header.data_offset + t.offset
        if offset + nbytes > file_size:
            raise GGUFError(f"{path} is truncated or corrupt: tensor {t.name} needs bytes {offset} .. {offset + nbytes} "
                            f"but the file has {file_size}")
        out[t.name] = TensorInfo(t.name, t.type_id, math.prod(t.dims[1:]), t.dims[0], len(t.dims), offset, nbytes)
    spans = sorted((i.offset, i.offset + i.nbytes, i.name) for i in out.values() if i.nbytes)
    for (a0, a1, a), (b0, _, b) in zip(spans, spans[1:]):
        if b0 < a1:
            raise GGUFError(f"{path}: tensors {a} and {b} overlap (bytes {b0} .. {a1})")
    return out
