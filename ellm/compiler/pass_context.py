"""What graph passes may depend on besides the graph itself."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..kv.plan import KVType
from ..targets import TargetPreset

if TYPE_CHECKING:
    from ..parallel.shard import TensorParallel
    from ..precision import PrecisionPlan

ACTIVATIONS = ("int8", "int16", "f32")


def auto_activations(target: TargetPreset) -> tuple[str, str]:
    """`--activations auto`: (one-token steps, multi-token chunks) on `target`: 8-bit activations, per 32
    inputs (llama.cpp's choice is per 256), for both.

    Chunks are compute-bound: 8-bit activations halve their dot products against 16-bit ones (two int8 halves).
    So are a speculative chain's verification steps, whose rows must round as one-token steps do (the verify
    entry equals decode bit for bit, so greedy speculation changes no token): with 16-bit step activations a
    step of 8 tokens cost 3.0x a decode step on SmolLM2 (Zen 4, 2 cores), with 8-bit ones 2.1x. One-token
    steps themselves are bandwidth-bound and decode as fast either way where 512-bit dot products keep up
    (measured within noise: 1.15x at 512 tokens, 0.95x at 8000); with 256-bit ones 16-bit steps do not keep
    up (a SmolLM2 FFN GEMV at 19 GB/s from cache against 24 GB/s from DRAM, Emerald Rapids, x86-64-v3).
    `--activations int16` keeps near-float matmuls (README, "Precision")."""
    from ..schedules.intdot import dot_for

    dot = dot_for(target)
    if dot is None:
        return "f32", "f32"
    return "int8", "int8"


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
    # bits attention's integer dot products round the query and the value weights to (None: those of the
    # one-token matmuls' activations, 16 for int16 and 8 for int8)
    attention_bits: int | None = None
    # NUMA nodes to plan the layout for at compile (None: planned at load for the machine present)
    numa_nodes: int | None = None
    # threads per node the kernels' tasks are planned for (numa_nodes entries; schedules/node_tasks.py)
    numa_threads: tuple[int, ...] | None = None
    # the slice of the model this artifact holds, as one rank of a tensor-parallel group (None: all of it)
    tensor_parallel: TensorParallel | None = None

    def __post_init__(self) -> None:
        if self.chunk_activations is None:
            object.__setattr__(self, "chunk_activations", self.activations)
        for a in (self.activations, self.chunk_activations):
            if a not in ACTIVATIONS:
                raise ValueError(f"activations must be one of {ACTIVATIONS}, got {a!r}")
        if (self.activations == "f32") != (self.chunk_activations == "f32"):
            raise ValueError("steps and chunks both use integer activations, or both float")
        if self.attention_bits not in (None, 8, 16):
            raise ValueError(f"attention_bits must be 8 or 16, got {self.attention_bits}")
        if self.numa_nodes is not None and not 1 <= self.numa_nodes <= 64:
            raise ValueError(f"numa_nodes must be between 1 and 64, got {self.numa_nodes}")
        if (self.numa_threads is not None) != (self.numa_nodes is not None) or (
                self.numa_threads is not None and (len(self.numa_threads) != self.numa_nodes or min(self.numa_threads) < 1)):
            raise ValueError(f"numa_threads needs one count >= 1 per node: {self.numa_threads} for {self.numa_nodes} nodes")

    @property
    def integer(self) -> bool:
        return self.activations in ("int8", "int16")
