"""eLLM's own GGUF header parser: plain little-endian reads over the file's bytes, every count and length checked
against the bytes left before anything is read or allocated, so a damaged or hostile header is one GGUFError,
never a MemoryError, a hang or a view past the end of the file. (It also opens a file in well under a
millisecond where the gguf package's reader, building a NumPy view per field part, takes tens: the fuzzer needs
thousands of opens.)"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import GGUFError

MAGIC = b"GGUF"
VERSIONS = (2, 3)  # version 1 used 32-bit counts and lengths; nothing current writes it
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 30


class ValueType(IntEnum):
    """GGUF metadata value types (the file format's numbering)."""

    UINT8 = 0
    INT8 = 1
    UINT16 = 2
    INT16 = 3
    UINT32 = 4
    INT32 = 5
    FLOAT32 = 6
    BOOL = 7
    STRING = 8
    ARRAY = 9
    UINT64 = 10
    INT64 = 11
    FLOAT64 = 12


# fixed-size scalars: little-endian NumPy dtype (values and arrays alike) and the kind the typed getters check
_SCALARS = {
    ValueType.UINT8: ("<u1", "int"), ValueType.INT8: ("<i1", "int"), ValueType.UINT16: ("<u2", "int"),
    ValueType.INT16: ("<i2", "int"), ValueType.UINT32: ("<u4", "int"), ValueType.INT32: ("<i4", "int"),
    ValueType.UINT64: ("<u8", "int"), ValueType.INT64: ("<i8", "int"), ValueType.FLOAT32: ("<f4", "float"),
    ValueType.FLOAT64: ("<f8", "float"), ValueType.BOOL: ("<u1", "bool"),
}


@dataclass(frozen=True)
class Field:
    """One metadata entry. `value`: a Python scalar or str; arrays a list of str or a read-only NumPy array."""

    key: str
    type: ValueType
    elem_type: ValueType | None  # arrays only
    value: Any

    @property
    def kind(self) -> str:
        """int, float, bool, string or "array of <kind>" (what the typed getters compare)."""
        if self.type is ValueType.ARRAY:
            return "array of " + _kind(self.elem_type)
        return _kind(self.type)

    def contents(self) -> Any:
        return self.value.tolist() if isinstance(self.value, np.ndarray) else self.value


def _kind(t: ValueType) -> str:
    return "string" if t is ValueType.STRING else _SCALARS[t][1]


@dataclass(frozen=True)
class TensorEntry:
    """A tensor-table row as written: dims in ggml order (ne0, the row length, first), offset relative to the data."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int


@dataclass(frozen=True)
class Header:
    version: int
    fields: dict[str, Field]
    tensors: list[TensorEntry]
    alignment: int
    data_offset: int  # absolute: the end of the header, padded to `alignment`


class _Reader:
    """A position in the file's bytes; every read first checks that the bytes are there."""

    def __init__(self, buf: memoryview, path: Path):
        self.buf, self.path, self.pos = buf, path, 0

    def fail(self, what: str) -> GGUFError:
        return GGUFError(f"{self.path} is truncated or corrupt: {what}")

    def need(self, n: int, what: str) -> None:
        if n > len(self.buf) - self.pos:
            raise self.fail(f"{what} at byte {self.pos} needs {n} bytes, the file has {len(self.buf) - self.pos} left")

    def unpack(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        self.need(size, what)
        v = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return v[0] if len(v) == 1 else v

    def string(self, what: str) -> str:
        n = self.unpack("<Q", what)
        self.need(n, what)
        raw = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise GGUFError(f"{self.path}: {what} is not UTF-8 (byte {e.start} of it is {raw[e.start]:#04x})") from None

    def value_type(self, what: str) -> ValueType:
        t = self.unpack("<I", what)
        try:
            return ValueType(t)
        except ValueError:
            raise self.fail(f"{what} has unknown value type {t}") from None

    def scalar(self, t: ValueType, what: str) -> Any:
        if t is ValueType.STRING:
            return self.string(what)
        dtype = np.dtype(_SCALARS[t][0])
        self.need(dtype.itemsize, what)
        v = np.frombuffer(self.buf, dtype=dtype, count=1, offset=self.pos)[0].item()
        self.pos += dtype.itemsize
        return bool(v) if t is ValueType.BOOL else v

    def array(self, key: str) -> tuple[ValueType, Any]:
        what = f"metadata key {key}"
        elem = self.value_type(what + "'s element type")
        count = self.unpack("<Q", what + "'s length")
        if elem is ValueType.ARRAY:
            raise GGUFError(f"{self.path}: metadata key {key} is an array of arrays, which no model uses")
        if elem is ValueType.STRING:
            self.need(8 * count, f"{what}'s {count} strings")  # each at least its length
            return elem, [self.string(f"{what}[{i}]") for i in range(count)]
        dtype = np.dtype(_SCALARS[elem][0])
        self.need(count * dtype.itemsize, f"{what}'s {count} values")
        arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos)
        self.pos += count * dtype.itemsize
        return elem, (arr != 0 if elem is ValueType.BOOL else arr)


# the fewest bytes a metadata entry (key length, type, one-byte value) and a tensor row (name length, n_dims,
# one dim, type, offset) can take: counts beyond what the file could hold are refused before any loop runs
_MIN_KV, _MIN_TENSOR = 8 + 4 + 1, 8 + 4 + 8 + 4 + 8


def parse_header(buf: memoryview, path: Path) -> Header:
    """The header, metadata and tensor table of the GGUF in `buf`, each read checked against the bytes left."""
    r = _Reader(buf, path)
    r.need(4, "the magic bytes")
    if bytes(buf[:4]) != MAGIC:
        raise GGUFError(f"{path} is not a GGUF file (magic bytes {bytes(buf[:4])!r}, expected {MAGIC!r})")
    r.pos = 4
    version = r.unpack("<I", "the version")
    if version not in VERSIONS:
        swapped = struct.unpack("<I", struct.pack(">I", version))[0]
        hint = " (a big-endian file; eLLM reads little-endian GGUF)" if swapped in VERSIONS else ""
        raise GGUFError(f"{path} has GGUF version {version}{hint}; eLLM reads versions 2 and 3")
    n_tensors, n_kv = r.unpack("<QQ", "the tensor and metadata counts")
    left = len(buf) - r.pos
    if n_kv * _MIN_KV > left or n_tensors * _MIN_TENSOR > left:
        raise r.fail(f"the header claims {n_tensors} tensors and {n_kv} metadata entries, more than its {left} "
                     "bytes can hold")

    fields: dict[str, Field] = {}
    for i in range(n_kv):
        key = r.string(f"metadata key #{i}")
        if key in fields:
            raise GGUFError(f"{path}: metadata key {key} appears twice")
        t = r.value_type(f"metadata key {key}")
        if t is ValueType.ARRAY:
            elem, value = r.array(key)
            fields[key] = Field(key, t, elem, value)
        else:
            fields[key] = Field(key, t, None, r.scalar(t, f"metadata key {key}"))

    alignment = DEFAULT_ALIGNMENT
    if "general.alignment" in fields:
        a = fields["general.alignment"]
        if a.kind != "int" or not 0 < a.value <= MAX_ALIGNMENT or a.value & (a.value - 1):
            raise GGUFError(f"{path}: general.alignment is {a.value!r}; it must be a power of two up to 2^30")
        alignment = int(a.value)

    tensors: list[TensorEntry] = []
    names: set[str] = set()
    for i in range(n_tensors):
        name = r.string(f"tensor #{i}'s name")
        if name in names:
            raise GGUFError(f"{path}: tensor {name} appears twice in the tensor table")
        names.add(name)
        n_dims = r.unpack("<I", f"tensor {name}'s dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise GGUFError(f"{path}: tensor {name} has {n_dims} dimensions (GGUF allows 1 .. {MAX_DIMS})")
        dims = r.unpack(f"<{n_dims}Q", f"tensor {name}'s dimensions")
        dims = (dims,) if n_dims == 1 else tuple(dims)
        type_id, offset = r.unpack("<IQ", f"tensor {name}'s type and offset")
        tensors.append(TensorEntry(name, dims, type_id, offset))

    data_offset = -(-r.pos // alignment) * alignment
    if tensors and data_offset > len(buf):
        raise r.fail(f"the tensor data should start at byte {data_offset}, past the end of the file ({len(buf)})")
    return Header(version, fields, tensors, alignment, data_offset)
