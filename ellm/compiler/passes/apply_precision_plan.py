"""Store each weight and each layer's KV cache at the type the precision plan chose, before fusion groups
weights by type (so siblings lowered alike still fuse)."""

from __future__ import annotations

from dataclasses import replace

from ..graph import Graph
from ..pass_context import PassContext


def apply_precision_plan(g: Graph, ctx: PassContext) -> Graph:
    plan = ctx.precision
    if plan is None:
        return g
    g = g.copy()
    types = plan.weight_types
    for name in g.names():
        op = g.op(name)
        # before fusion every weight is one GGUF tensor; a tied head and embedding share it (and its type)
        if any(w.sources[0] in types for w in op.weights):
            weights = tuple(replace(w, qtype=types.get(w.sources[0], w.qtype)) for w in op.weights)
            g.set_op(name, replace(op, weights=weights))
    if plan.kv_k is not None:
        cache = g.op("kv_cache")
        g.set_op("kv_cache", cache.with_attrs(planned_k=tuple(t.value for t in plan.kv_k),
                                              planned_v=tuple(t.value for t in plan.kv_v)))
    return g
