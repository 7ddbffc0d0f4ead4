"""Choose the KV cache's block layout and each layer's K and V precision, and tell every op that touches
the cache which storage class its layer uses (kernels are specialised per class).

Attention also gets the precision its integer dot products round the query and the value weights to
(`int_bits`): that of the one-token matmuls' activations (16 for int16, 8 for int8), so `--activations`
sets every integer factor of a step and prefill attention rounds as decode does."""

from __future__ import annotations

from ...kv.plan import KVPlan
from ..graph import Graph, OpKind
from ..pass_context import PassContext

CACHE_OPS = (OpKind.KV_APPEND, OpKind.ROPE_KV_APPEND, OpKind.ATTN_INPUT, OpKind.ATTENTION)


def plan_kv_cache(g: Graph, ctx: PassContext) -> Graph:
    g = g.copy()
    L, Hkv, _, hd = g.op("kv_cache").out.shape
    kv = ctx.kv
    if kv.k is None or kv.v is None:
        plan = KVPlan.auto(int(L), int(Hkv), int(hd), kv.max_chunk, kv.k, kv.v, kv.block, kv.recent)
    else:
        plan = KVPlan.uniform(int(L), int(Hkv), int(hd), kv.k, kv.v, kv.max_chunk, kv.block, kv.recent)
    key = plan.key()
    int_bits = 8 if ctx.activations == "int8" else 16
    g.set_op("kv_cache", g.op("kv_cache").with_attrs(kv_plan=key))
    for name in g.names():
        op = g.op(name)
        if op.kind in CACHE_OPS:
            op = op.with_attrs(kv_plan=key, kv_k=plan.k[op.layer].value, kv_v=plan.v[op.layer].value)
            g.set_op(name, op.with_attrs(int_bits=int_bits) if op.kind is OpKind.ATTENTION else op)
    return g
