"""The compiler pipeline: one list of graph passes, in phases."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

from .graph import Graph
from .pass_context import PassContext
from .passes import (
    apply_precision_plan,
    choose_weight_layout,
    fuse_attention_input,
    fuse_ffn,
    fuse_residual_add,
    fuse_rmsnorm_matmul,
    fuse_rope_kv_append,
    fuse_sibling_matmuls,
    plan_kv_cache,
    plan_numa_layout,
    shard_tensor_parallel,
    split_vocab_head,
)


Pass = Callable[[Graph, PassContext], Graph]


@dataclass(frozen=True)
class Phase:
    name: str
    passes: tuple[Pass, ...]


PIPELINE: tuple[Phase, ...] = (
    Phase(
        "precision",
        (
            apply_precision_plan,  # weights and KV layers at the plan's types (--quant-level, --precision auto)
            split_vocab_head,  # the head's likely tokens at its type, the rest coarser (when the plan splits it)
        ),
    ),
    Phase(
        "parallel",
        (shard_tensor_parallel,),  # one rank's heads, FFN rows and vocabulary rows; all-reduces (ellm compile --tp)
    ),
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
        (choose_weight_layout,),  # per weight and target: GGUF rows, or 16-row tiles for integer kernels
    ),
    Phase(
        "kernel fusion",
        (
            fuse_attention_input,  # norm + QKV + RoPE + KV append -> one kernel (integer path)
            fuse_ffn,  # gate+up, SiLU * mul, down + residual -> one kernel (integer path; opt-in, see below)
        ),
    ),
    Phase(
        "memory",
        (
            plan_kv_cache,  # KV block layout, per-layer K/V precision; cache ops learn their storage class
            plan_numa_layout,  # weight rows and KV heads per NUMA node (--numa-nodes N; recorded in the manifest)
        ),
    ),
)


# Passes that run only when asked for (`ellm compile --enable-pass NAME`). fuse_ffn keeps the FFN
# intermediate inside one kernel, but on SmolLM2 it measured no faster for decode and ~10% slower for
# prefill than three well-blocked kernels (README, "Fusions"); models whose intermediate does not fit
# in cache may gain.
OPT_IN = frozenset({"fuse_ffn"})
# Passes the lowering depends on: they cannot be disabled.
REQUIRED = frozenset({"plan_kv_cache", "apply_precision_plan", "split_vocab_head", "shard_tensor_parallel"})


def pass_names(pipeline: Sequence[Phase] = PIPELINE) -> list[str]:
    return [p.__name__ for phase in pipeline for p in phase.passes]


def optional_pass_names(pipeline: Sequence[Phase] = PIPELINE) -> list[str]:
    """The passes `--disable-pass` may switch off."""
    return [n for n in pass_names(pipeline) if n not in REQUIRED]


def enabled_passes(disable: Sequence[str] = (), enable: Sequence[str] = (), pipeline: Sequence[Phase] = PIPELINE) -> list[str]:
    """Names of the passes that run: all but opt-in ones and `disable`, plus the opt-in ones in `enable`."""
    known = pass_names(pipeline)
    unknown = (set(disable) | set(enable)) - set(known)
    if unknown:
        raise ValueError(f"unknown passes: {sorted(unknown)}; known: {known}")
    if REQUIRED & set(disable):
        raise ValueError(f"passes {sorted(REQUIRED & set(disable))} are required and cannot be disabled")
    return [p for p in known if p not in disable and (p not in OPT_IN or p in enable)]


def run_pipeline(
    g: Graph, ctx: PassContext, pipeline: Sequence[Phase] = PIPELINE, disable: Sequence[str] = (), enable: Sequence[str] = ()
) -> Graph:
    """Apply the enabled passes in order, checking the graph's invariants after each."""
    active = set(enabled_passes(disable, enable, pipeline))
    for phase in pipeline:
        for p in phase.passes:
            if p.__name__ not in active:
                continue
            g = p(g, ctx)
            g.check()
    return g
