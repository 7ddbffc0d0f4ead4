"""The compiler pipeline: one list of graph passes, in phases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .graph import Graph
from .pass_context import PassContext
from .passes import (
    choose_weight_layout,
    fuse_attention_input,
    fuse_ffn,
    fuse_residual_add,
    fuse_rmsnorm_matmul,
    fuse_rope_kv_append,
    fuse_sibling_matmuls,
)


Pass = Callable[[Graph, PassContext], Graph]


@dataclass(frozen=True)
class Phase:
    name: str
    passes: tuple[Pass, ...]


PIPELINE: tuple[Phase, ...] = (
    Phase(
        "fusion",
        (
            fuse_sibling_matmuls,  # Q+K+V, gate+up
            fuse_rmsnorm_matmul,  # norm -> its matmuls' prologue
            fuse_residual_add,  # residual add -> matmul epilogue
            fuse_rope_kv_append,  # rope(q), rope(k), kv-append -> one kernel
        ),
    ),
    Phase(
        "layout",
        (choose_weight_layout,),  # per weight and target: GGUF rows, or 16-row tiles for VNNI
    ),
    Phase(
        "kernel fusion",
        (
            fuse_attention_input,  # norm + QKV + RoPE + KV append -> one kernel (integer path)
            fuse_ffn,  # gate+up, SiLU * mul, down + residual -> one kernel (integer path)
        ),
    ),
)


def pass_names(pipeline: Sequence[Phase] = PIPELINE) -> list[str]:
    return [p.__name__ for phase in pipeline for p in phase.passes]


def run_pipeline(g: Graph, ctx: PassContext, pipeline: Sequence[Phase] = PIPELINE, disable: Sequence[str] = ()) -> Graph:
    """Apply every pass not named in `disable`, checking the graph's invariants after each."""
    unknown = set(disable) - set(pass_names(pipeline))
    if unknown:
        raise ValueError(f"unknown passes: {sorted(unknown)}; known: {pass_names(pipeline)}")
    for phase in pipeline:
        for p in phase.passes:
            if p.__name__ in disable:
                continue
            g = p(g, ctx)
            g.check()
    return g
