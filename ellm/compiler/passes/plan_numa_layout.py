"""Plan the NUMA layout for a stated node count (`ellm compile --numa-nodes N`): which rows of every matmul
weight and which KV heads each node holds, recorded in the manifest so that a fleet's artifact carries its
layout; load uses it on a machine with that many nodes in use, and plans for the machine otherwise
(numa/placement.py). The graph itself is unchanged: placement moves bytes, not ops."""

from __future__ import annotations

from ...numa.plan import TILE_ROWS, WeightRows, plan_layout
from ...numa.topology import NumaNode, Topology
from ..graph import Graph, OpKind
from ..pass_context import PassContext

QKV = "attn_q+attn_k+attn_v"


def plan_numa_layout(g: Graph, ctx: PassContext) -> Graph:
    if ctx.numa_nodes is None:
        return g
    _, n_kv_heads, _, head_dim = g.op("kv_cache").out.shape
    weights: dict[str, WeightRows] = {}
    for name in g.names():
        op = g.op(name)
        if op.kind == OpKind.EMBEDDING:  # gathered, one row per token: interleaved, not split
            continue
        for w in op.weights:
            units = -(-w.rows // TILE_ROWS)
            heads = None
            if QKV in w.name:
                n_heads = (w.rows - 2 * int(n_kv_heads) * int(head_dim)) // int(head_dim)
                heads = (n_heads, int(n_kv_heads), int(head_dim))
            weights.setdefault(w.name, WeightRows(w.name, units, w.nbytes / units, heads))
    plan = plan_layout(list(weights.values()), int(n_kv_heads), stated_topology(ctx.numa_nodes))
    g = g.copy()
    g.set_meta("numa", plan.to_dict() | {"imbalance": plan.imbalance()})
    return g


def stated_topology(n_nodes: int) -> Topology:
    """N equal nodes of one core each: the plan depends on the node count, not on cores (threads are mapped
    to the nodes at load)."""
    nodes = tuple(NumaNode(k, (k,), ((k,),), 0) for k in range(n_nodes))
    return Topology(nodes, tuple(tuple(10 if i == j else 20 for j in range(n_nodes)) for i in range(n_nodes)))
