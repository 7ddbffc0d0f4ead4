"""Rewrite a GGUF with some metadata changed (types included), patch its tensor table in place, or take it apart
into plain data and write it back byte by byte: the bad files the loaders must refuse with one line."""

from __future__ import annotations

import shutil
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
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


# --- a GGUF as plain data, and its bytes: what the structured fuzzer mutates ------------------------------------
_FMT = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q", 11: "<q", 12: "<d"}


@dataclass
class Spec:
    """A GGUF file's parts, each free to be made wrong: `fields` (key, value type, element type or None, value:
    str, bytes (a raw string), number or list), `tensors` (name, ggml dims, type id, data offset relative to the
    data), the counts the header claims (None: the true ones), and the data bytes."""

    fields: list[tuple[str, int, int | None, Any]]
    tensors: list[tuple[str, list[int], int, int]]
    data: bytes
    version: int = 3
    alignment: int = 32
    n_kv: int | None = None
    n_tensors: int | None = None


def spec_of(path: Path) -> Spec:
    """The parts of a good file, read with the gguf package's reader (independent of eLLM's parser)."""
    r = GGUFReader(path)
    fields = []
    for name, f in r.fields.items():
        if not name.startswith("GGUF."):
            t = [int(x) for x in f.types]
            fields.append((name, t[0], t[1] if len(t) > 1 else None, f.contents()))
    start = min(int(t.data_offset) for t in r.tensors)
    tensors = [(t.name, [int(x) for x in t.shape.tolist()], int(t.tensor_type), int(t.data_offset) - start)
               for t in r.tensors]
    data = bytes(r.data[start:])
    return Spec(fields, tensors, data, alignment=int(r.alignment))


def _string(s) -> bytes:
    raw = s if isinstance(s, bytes) else str(s).encode("utf-8", "surrogatepass")
    return struct.pack("<Q", len(raw)) + raw


def _scalar(t: int, v) -> bytes:
    if t == 8:
        return _string(v)
    fmt = _FMT[t]
    if fmt[1] in "fd":
        with np.errstate(over="ignore"):  # too large for float32: inf, as a writer would store it
            return (np.float32 if fmt[1] == "f" else np.float64)(_number(v, float)).tobytes()
    bits = 8 * struct.calcsize(fmt)
    return struct.pack(fmt.upper() if fmt[1].islower() else fmt, _number(v, int) % (1 << bits))  # any int, wrapped


def _number(v, kind):
    """A value kept across a type change as the new type's number (0 where it has none)."""
    try:
        return kind(v)
    except (TypeError, ValueError, OverflowError):
        return kind(0)


def encode(spec: Spec) -> bytes:
    """The file `spec` describes; values are wrapped to their type's width rather than refused."""
    n_tensors = len(spec.tensors) if spec.n_tensors is None else spec.n_tensors
    n_kv = len(spec.fields) if spec.n_kv is None else spec.n_kv
    out = [b"GGUF", struct.pack("<IQQ", spec.version % (1 << 32), n_tensors % (1 << 64), n_kv % (1 << 64))]
    for key, t, elem, value in spec.fields:
        out += [_string(key), struct.pack("<I", t)]
        if t == 9:
            items = list(value) if isinstance(value, (list, tuple)) else [value]
            out.append(struct.pack("<IQ", elem, len(items)))
            out += [_scalar(elem, v) for v in items] if elem in _FMT or elem == 8 else []
        elif t in _FMT or t == 8:
            out.append(_scalar(t, value))
    for name, dims, type_id, offset in spec.tensors:
        out += [_string(name), struct.pack("<I", len(dims)), *(struct.pack("<Q", d % (1 << 64)) for d in dims),
                struct.pack("<IQ", type_id % (1 << 32), offset % (1 << 64))]
    head = b"".join(out)
    pad = -len(head) % spec.alignment if spec.alignment > 0 else 0
    return head + b"\0" * pad + spec.data
