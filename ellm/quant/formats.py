"""The supported GGUF tensor types and how each is split into typed component arrays for TIR kernels."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from math import prod

from ..errors import GGUFError


class QuantType(enum.IntEnum):
    """GGML tensor type ids (values match `gguf.GGMLQuantizationType`)."""

    F32 = 0
    F16 = 1
    Q4_0 = 2
    Q4_1 = 3
    Q8_0 = 8
    Q4_K = 12
    Q6_K = 14
    BF16 = 30


@dataclass(frozen=True)
class Component:
    """One typed array of a packed weight: `per_block` elements of `dtype` per quant block of a row."""

    name: str
    dtype: str
    per_block: int


@dataclass(frozen=True)
class WeightFormat:
    """A GGUF block format and its split into components.

    A row of K weights is K // block blocks. GGUF interleaves each block's scales and quants in one
    struct; kernels want typed arrays, so each field becomes a component of shape
    [rows, K // block * per_block]. The split is lossless: component bytes are GGUF's bytes, except
    Q4_K's 6-bit packed scales, which are widened to one byte each.

    `sub_axes` factor the in-block index so every quant/scale index is affine in them:
    element = block_index * block + sum(sub_i * stride_i), the last axis being contiguous bytes.
    """

    qtype: QuantType
    block: int
    block_bytes: int  # GGUF bytes per block
    components: tuple[Component, ...]
    sub_axes: tuple[int, ...]

    @property
    def name(self) -> str:
        return self.qtype.name

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.block_bytes / self.block

    def component_shape(self, comp: Component, rows: int, cols: int) -> tuple[int, int]:
        return (rows, cols // self.block * comp.per_block)

    def row_bytes(self, cols: int) -> int:
        return cols // self.block * self.block_bytes

    def check_cols(self, cols: int, tensor: str = "tensor") -> None:
        if cols % self.block:
            raise GGUFError(f"{tensor}: row length {cols} is not a multiple of the {self.name} block size {self.block}")

    def __post_init__(self) -> None:
        assert prod(self.sub_axes) == self.block, self


_C = Component
FORMATS: dict[QuantType, WeightFormat] = {
    f.qtype: f
    for f in (
        # Float types: a "block" is one 16-wide vector of weights.
        WeightFormat(QuantType.F32, 16, 64, (_C("w", "float32", 16),), (16,)),
        WeightFormat(QuantType.F16, 16, 32, (_C("w", "float16", 16),), (16,)),
        WeightFormat(QuantType.BF16, 16, 32, (_C("w", "uint16", 16),), (16,)),
        # Q8_0: d (f16) + 32 x int8; w = q * d.
        WeightFormat(QuantType.Q8_0, 32, 34, (_C("qs", "int8", 32), _C("d", "float16", 1)), (32,)),
        # Q4_0: d + 16 bytes; byte i holds elements i (low nibble) and i + 16 (high); w = d * (q - 8).
        WeightFormat(QuantType.Q4_0, 32, 18, (_C("qs", "uint8", 16), _C("d", "float16", 1)), (2, 16)),
        # Q4_1: d, m + 16 bytes (same nibble order as Q4_0); w = d * q + m.
        WeightFormat(
            QuantType.Q4_1, 32, 20, (_C("qs", "uint8", 16), _C("d", "float16", 1), _C("m", "float16", 1)), (2, 16)
        ),
        # Q4_K: super-block of 256 = 8 sub-blocks of 32 with 6-bit scale/min; 64-element chunks of
        # 32 bytes: low nibbles are sub-block 2c, high nibbles sub-block 2c + 1.
        # w = (d * sc) * q - (dmin * mn).
        WeightFormat(
            QuantType.Q4_K,
            256,
            144,
            (
                _C("qs", "uint8", 128),
                _C("sc", "uint8", 8),
                _C("mn", "uint8", 8),
                _C("d", "float16", 1),
                _C("dmin", "float16", 1),
            ),
            (4, 2, 32),
        ),
        # Q6_K: super-block of 256 in two halves of 128; 4 low bits in ql, 2 high bits in qh,
        # 16 int8 scales; w = (d * sc) * (q - 32).
        WeightFormat(
            QuantType.Q6_K,
            256,
            210,
            (_C("ql", "uint8", 128), _C("qh", "uint8", 64), _C("sc", "int8", 16), _C("d", "float16", 1)),
            (2, 4, 2, 16),
        ),
    )
}


def format_of(type_id: int, tensor: str = "tensor") -> WeightFormat:
    """The format for a GGML type id, or a clear error naming the unsupported type."""
    try:
        qtype = QuantType(int(type_id))
    except ValueError:
        try:
            import gguf

            name = gguf.GGMLQuantizationType(int(type_id)).name
        except Exception:  # unknown even to gguf
            name = f"type id {int(type_id)}"
        supported = ", ".join(q.name for q in QuantType)
        raise GGUFError(f"{tensor}: unsupported tensor type {name} (supported: {supported})") from None
    return FORMATS[qtype]
