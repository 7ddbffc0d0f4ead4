"""Plan the NUMA layout for a stated node count (`ellm compile --numa-nodes N --numa-threads T`): which rows of
every matmul weight and which KV heads each node holds, recorded in the manifest so that a fleet's artifact
carries its layout, and the kernels' parallel tasks that follow it (each op's `numa_tasks`, honoured by the
integer matmuls, the fused attention input and attention: schedules/node_tasks.py). Load uses the plan
on a machine with that many nodes in use, and plans for the machine otherwise (numa/placement.py)."""

from __future__ import annotations

from ...numa.plan import TILE_ROWS, WeightRows, plan_layout
from ...numa.topology import NumaNode, Topology
from ...schedules.node_tasks import ATTR, NodeTasks
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
    threads = ctx.numa_threads or (1,) * ctx.numa_nodes
    plan = plan_layout(list(weights.values()), int(n_kv_heads), stated_topology(threads))
    g = g.copy()
    for name in g.names():
        op = g.op(name)
        if op.kind in TASKED and len(op.weights) == 1:  # [node] -> tile ranges of its weight
            tasks = NodeTasks.make(threads, plan.matrix(op.weight.name).ranges)
        elif op.kind is OpKind.ATTENTION:  # [node] -> its KV heads
            tasks = NodeTasks.make(threads, [[r] for r in plan.kv_heads])
        else:
            continue
        g.set_op(name, op.with_attrs(**{ATTR: tasks.to_attr()}))
    g.set_meta("numa", plan.to_dict() | {"imbalance": plan.imbalance()})
    return g


TASKED = (OpKind.MATMUL, OpKind.LM_HEAD, OpKind.ATTN_INPUT)


def stated_topology(threads: tuple[int, ...]) -> Topology:
    """One node per entry of `threads`, with that many cores (CPU ids in order): the plan's weight and head
    ranges depend on the node count, its tasks on the threads of each node."""
    nodes, first = [], 0
    for k, t in enumerate(threads):
        cpus = tuple(range(first, first + t))
        nodes.append(NumaNode(k, cpus, tuple((c,) for c in cpus), 0))
        first += t
    n = len(threads)
    return Topology(tuple(nodes), tuple(tuple(10 if i == j else 20 for j in range(n)) for i in range(n)))
