"""Choose the KV cache's block layout and each layer's K and V precision, and tell every op that touches
the cache which storage class its layer uses (kernels are specialised per class). The
types come from the precision plan where apply_precision_plan recorded one, else from the KV options.

Attention also gets the precision its integer dot products round the query and the value weights to
(`int_bits`): the pass context's attention bits (`--activations auto`: 16 with 512-bit dot products, 8 with
256-bit ones), else that of the one-token matmuls' activations (16 for int16, 8 for int8), so an explicit
`--activations` sets every integer factor of a step. Prefill attention rounds as decode does."""

from __future__ import annotations

from ...kv.plan import KVPlan, KVType
from ..graph import Graph, OpKind
from ..pass_context import PassContext

CACHE_OPS = (OpKind.KV_APPEND, OpKind.ROPE_KV_APPEND, OpKind.ATTN_INPUT, OpKind.ATTENTION)


def plan_kv_cache(g: Graph, ctx: PassContext) -> Graph:
    g = g.copy()
    L, Hkv, _, hd = g.op("kv_cache").out.shape
    kv = ctx.kv
    planned_k, planned_v = g.op("kv_cache").attr("planned_k"), g.op("kv_cache").attr("planned_v")
    if planned_k is not None and (kv.k is None or kv.v is None):
        # the precision plan's per-layer types; an explicit --cache-type-k/v overrides its side
        k = (kv.k,) * int(L) if kv.k is not None else tuple(KVType(t) for t in planned_k)
        v = (kv.v,) * int(L) if kv.v is not None else tuple(KVType(t) for t in planned_v)
        plan = KVPlan.per_layer(int(Hkv), int(hd), k, v, kv.max_chunk, kv.block, kv.recent, kv.pinned, kv.rotate_k)
    elif kv.k is None or kv.v is None:
        plan = KVPlan.auto(int(L), int(Hkv), int(hd), kv.max_chunk, kv.k, kv.v, kv.block, kv.recent,
                           pinned=kv.pinned, rotate_k=kv.rotate_k)
    else:
        plan = KVPlan.uniform(int(L), int(Hkv), int(hd), kv.k, kv.v, kv.max_chunk, kv.block, kv.recent, kv.pinned,
                              kv.rotate_k)
    key = plan.key()
    int_bits = ctx.attention_bits or (8 if ctx.activations == "int8" else 16)
    g.set_op("kv_cache", g.op("kv_cache").with_attrs(kv_plan=key))
    for name in g.names():
        op = g.op(name)
        if op.kind in CACHE_OPS:
            op = op.with_attrs(kv_plan=key, kv_k=plan.k[op.layer].value, kv_v=plan.v[op.layer].value)
            g.set_op(name, op.with_attrs(int_bits=int_bits) if op.kind is OpKind.ATTENTION else op)
    return g
