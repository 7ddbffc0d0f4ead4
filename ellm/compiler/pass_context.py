"""What graph passes may depend on besides the graph itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..kv.plan import KVType
from ..targets import TargetPreset

if TYPE_CHECKING:
    from ..precision import PrecisionPlan

ACTIVATIONS = ("int8", "int16", "f32")


def auto_activations(target: TargetPreset) -> tuple[str, str]:
    """`--activations auto`: (one-token steps, multi-token chunks) on `target`.

    Chunks are compute-bound: 8-bit activations (llama.cpp's choice, at a finer scale: per 32 inputs, not 256)
    halve their dot products. One-token steps are bandwidth-bound where 512-bit dot products keep up with
    16-bit activations (two int8 halves, twice the dot products, near-float accuracy). With 256-bit ones they
    do not: two cores run a SmolLM2 FFN GEMV at 19 GB/s from cache with 16-bit activations (26 GB/s with
    8-bit) against 24 GB/s from DRAM (Emerald Rapids, x86-64-v3), so those steps take 8-bit ones too.
    """
    from ..schedules.intdot import dot_for

    dot = dot_for(target)
    if dot is None:
        return "f32", "f32"
    return ("int16" if dot.width == 512 else "int8"), "int8"


@dataclass(frozen=True)
class KVOptions:
    """What the KV-cache planning pass chooses from: K and V types, block size, recent tier, chunk bound."""

    k: KVType | None = None  # None: auto (KVPlan.auto chooses per layer)
    v: KVType | None = None
    block: int = 64  # tokens per block
    recent: int = 2  # blocks (the current one included) a query reads from the float16 ring
    max_chunk: int = 256  # the most tokens one step writes (sizes the ring)
    pinned: int = 1  # first blocks kept in the float16 ring (attention sinks)
    rotate_k: bool = True  # quantised keys stored in the head's Hadamard basis


@dataclass(frozen=True)
class PassContext:
    """What passes may depend on besides the graph: the target, and the activation precision of matmuls."""

    target: TargetPreset
    # Matmul activations of one-token steps: "int8" / "int16" quantised per 32 inputs for integer dot products
    # (int16 as two int8 halves: twice the dot products, near-float accuracy); "f32": float kernels.
    activations: str = "int16"
    # ... and of multi-token chunks (prefill, verification), which are compute-bound where steps are not
    # (None: as steps)
    chunk_activations: str | None = None
    kv: KVOptions = field(default_factory=KVOptions)
    # storage types below the source's, per weight and KV layer (None: weights as the GGUF stores them)
    precision: PrecisionPlan | None = None

    def __post_init__(self) -> None:
        if self.chunk_activations is None:
            object.__setattr__(self, "chunk_activations", self.activations)
        for a in (self.activations, self.chunk_activations):
            if a not in ACTIVATIONS:
                raise ValueError(f"activations must be one of {ACTIVATIONS}, got {a!r}")
        if (self.activations == "f32") != (self.chunk_activations == "f32"):
            raise ValueError("steps and chunks both use integer activations, or both float")

    @property
    def integer(self) -> bool:
        return self.activations in ("int8", "int16")
