"""Open and validate a GGUF file once, so every later stage can trust its metadata and tensor bytes."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import GGUFError
from ..quant import QuantType, WeightFormat, format_of

GGUF_MAGIC = b"GGUF"


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


class GGUFFile:
    """A validated GGUF file: metadata as Python values and raw tensor bytes as read-only views."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise GGUFError(f"cannot read {self.path}: {e.strerror}") from None
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (magic bytes {magic!r}, expected {GGUF_MAGIC!r})")
        try:
            self._reader = gguf.GGUFReader(self.path, "r")
        except Exception as e:  # the reader raises ValueError/IndexError/... on damaged files
            raise GGUFError(f"{self.path} is truncated or corrupt: {type(e).__name__}: {e}") from None
        self.file_size = self.path.stat().st_size
        self.tensors: dict[str, TensorInfo] = {}
        for t in self._reader.tensors:
            shape = [int(x) for x in t.shape]
            cols = shape[0]
            rows = int(np.prod(shape[1:])) if len(shape) > 1 else 1
            info = TensorInfo(t.name, int(t.tensor_type), rows, cols, len(shape), int(t.data_offset), int(t.n_bytes))
            if info.offset + info.nbytes > self.file_size:
                raise GGUFError(
                    f"{self.path} is truncated: tensor {t.name} needs bytes up to {info.offset + info.nbytes} "
                    f"but the file has {self.file_size}"
                )
            self.tensors[t.name] = info
        self._metadata = {k: f for k, f in self._reader.fields.items()}

    # --- metadata -------------------------------------------------------------------------
    def get(self, key: str, default: Any = None) -> Any:
        field = self._metadata.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:
            raise GGUFError(f"{self.path}: metadata key {key} is unreadable: {e}") from None

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise GGUFError(f"{self.path}: required metadata key {key} is missing")
        return value

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
        flat = self._reader.data[info.offset : info.offset + info.nbytes]
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
