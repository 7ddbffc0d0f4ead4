"""Open and validate a GGUF file once, so every later stage can trust its metadata and tensor bytes."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import GGUFError
from ..quant import QuantType, WeightFormat, format_of
from .gguf_header import MAGIC, Field, parse_header
from .gguf_table import TensorInfo, check_table

GGUF_MAGIC = MAGIC

__all__ = ["GGUFFile", "TensorInfo", "GGUF_MAGIC"]

_MISSING = object()


class GGUFFile:
    """A validated GGUF file: metadata as Python values and raw tensor bytes as read-only views."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise GGUFError(f"cannot read {self.path}: {e.strerror}") from None
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (magic bytes {magic!r}, expected {GGUF_MAGIC!r})")
        self._data = np.memmap(self.path, dtype=np.uint8, mode="r")  # read-only: views can never write the file
        self.file_size = int(self._data.size)
        header = parse_header(memoryview(self._data), self.path)
        self.version = header.version
        self.alignment = header.alignment
        self.tensors: dict[str, TensorInfo] = check_table(self.path, header, self.file_size)
        self._metadata: dict[str, Field] = header.fields

    # --- metadata -------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        field = self._metadata.get(key)
        return default if field is None else field.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: required metadata key {key} is missing")
        return value

    # --- typed metadata: a value of the wrong type is refused with its key's name ----------------
    def _typed(self, key: str, default: Any, want: str) -> Any:
        """The value of `key` if it is of kind `want` (Field.kind; integers pass for floats), else `default`
        where the key is absent; a missing required key or a value of another kind is refused."""
        field = self._metadata.get(key)
        if field is None:
            if default is _MISSING:
                raise GGUFError(f"{self.path}: required metadata key {key} is missing")
            return default
        have = field.kind
        if have != want and not (want.endswith("float") and have == want[: -len("float")] + "int"):
            raise GGUFError(f"{self.path}: metadata key {key} should be {described(want)}, is {described(have)}")
        return self.get(key)

    def get_int(self, key: str, default: Any = _MISSING, minimum: int | None = None) -> int:
        """An integer value (any integer type); with `minimum`, at least that."""
        v = self._typed(key, default, "int")
        if v is not None and minimum is not None and int(v) < minimum:
            raise GGUFError(f"{self.path}: metadata key {key} is {v}, must be at least {minimum}")
        return v if v is None else int(v)

    def get_float(self, key: str, default: Any = _MISSING, positive: bool = False) -> float:
        """A finite number (float or integer type); with `positive`, above 0."""
        v = self._typed(key, default, "float")
        if v is None:
            return v
        v = float(v)
        if not math.isfinite(v) or (positive and not v > 0):
            raise GGUFError(f"{self.path}: metadata key {key} is {v}, must be a finite{' positive' if positive else ''} number")
        return v

    def get_str(self, key: str, default: Any = _MISSING) -> str:
        return self._typed(key, default, "string")

    def get_bool(self, key: str, default: Any = _MISSING) -> bool:
        v = self._typed(key, default, "bool")
        return v if v is None else bool(v)

    def get_array(self, key: str, of: str, default: Any = _MISSING) -> list:
        """An array whose elements are `of` ("int", "float", "string")."""
        field = self._metadata.get(key)
        v = self._typed(key, default, f"array of {of}")
        return v if field is None else list(v)

    def keys(self) -> list[str]:
        return list(self._metadata)

    # --- tensors --------------------------------------------------------------------------
    def has(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path}: tensor {name} is missing") from None

    def weight_format(self, name: str) -> WeightFormat:
        info = self.info(name)
        fmt = format_of(info.type_id, name)
        fmt.check_cols(info.cols, name)
        return fmt

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes as a read-only [rows, row_bytes] uint8 view of the memory-mapped file."""
        info = self.info(name)
        flat = self._data[info.offset : info.offset + info.nbytes]
        return flat.reshape(info.rows, -1)

    def vector(self, name: str) -> np.ndarray:
        """A 1-D tensor (norm weights, biases) as float32."""
        info = self.info(name)
        if info.rows != 1:
            raise GGUFError(f"{self.path}: tensor {name} should be 1-D, has {info.rows} rows")
        raw = self.raw(name).reshape(-1)
        if info.type_id == QuantType.F32:
            return raw.view(np.float32).copy()
        if info.type_id == QuantType.F16:
            return raw.view(np.float16).astype(np.float32)
        if info.type_id == QuantType.BF16:
            return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
        raise GGUFError(f"{self.path}: 1-D tensor {name} has type {info.type_id}; expected F32, F16 or BF16")

    def sha256(self) -> str:
        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        return h.hexdigest()


ARTICLE = {"int": "an integer", "float": "a number", "bool": "a boolean", "string": "a string"}


def described(kind: str) -> str:
    return ARTICLE.get(kind) or (f"an {kind}s" if kind.startswith("array of ") else f"of {kind} type")
