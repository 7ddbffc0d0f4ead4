"""Rewrite a GGUF with some metadata changed (types included), or patch its tensor table in place: the bad files
the loaders must refuse with one line."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import gguf
from gguf import GGUFReader, GGUFValueType

DROP = object()


def rewrite(src: Path, dst: Path, changes: dict[str, Any]) -> Path:
    """`src` with metadata `changes`: key -> (value, GGUFValueType[, element type]) or DROP."""
    r = GGUFReader(src)
    w = gguf.GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for name, field in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in changes:
            continue
        types = field.types
        w.add_key_value(name, field.contents(), types[0], types[1] if len(types) > 1 else None)
    for name, change in changes.items():
        if change is not DROP:
            w.add_key_value(name, *change)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)  # quantized: the byte shape gives the elements
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def patch_tensor(src: Path, dst: Path, name: str, *, dims: list[int] | None = None, offset: int | None = None) -> Path:
    """A copy of `src` whose tensor `name` has other dimensions (ggml order) or data offset (relative)."""
    shutil.copyfile(src, dst)
    r = GGUFReader(dst, "r+")
    (t,) = [t for t in r.tensors if t.name == name]
    parts = t.field.parts  # name_len, name, n_dims, dims, type, offset
    if dims is not None:
        assert len(dims) == len(parts[3])
        parts[3][:] = dims
    if offset is not None:
        parts[5][0] = offset
    r.data.flush()
    del r
    return dst


U32, I32, F32, STR, BOOL, ARR = (GGUFValueType.UINT32, GGUFValueType.INT32, GGUFValueType.FLOAT32,
                                 GGUFValueType.STRING, GGUFValueType.BOOL, GGUFValueType.ARRAY)
