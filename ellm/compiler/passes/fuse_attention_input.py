"""Fuse the QKV projection (with its RMSNorm) into the RoPE + KV-append kernel: one kernel per layer
turns the residual stream into rotated q and an updated cache (integer path)."""

from __future__ import annotations

from ..graph import Graph, Op, OpKind, attrs
from ..pass_context import PassContext


def fuse_attention_input(g: Graph, ctx: PassContext) -> Graph:
    g = g.copy()
    if not ctx.target.isa is not None or not ctx.integer:
        return g
    for name in g.names(OpKind.ROPE_KV_APPEND):
        rk = g.op(name)
        cache, qkv_use = rk.inputs
        mm = g.op(qkv_use.src)
        if (
            mm.kind is not OpKind.MATMUL
            or qkv_use.cols is not None
            or g.consumers(qkv_use.src) != [name]
            or mm.vector("norm") is None
            or mm.attr("residual")
            or mm.weight.layout != "tile16"
        ):
            continue
        fused = Op(
            OpKind.ATTN_INPUT,
            rk.outs,  # (rotated q, updated cache)
            (cache, *mm.inputs),
            weights=mm.weights,
            vectors=mm.vectors,
            attrs=attrs(**dict(rk.attrs), norm_eps=mm.attr("norm_eps"), act_bits=mm.attr("act_bits"),
                        chunk_act_bits=mm.attr("chunk_act_bits")),
            layer=rk.layer,
        )
        fused_name = name.replace("rope_kv_append", "attention_input")
        g.add(fused_name, fused)
        g.replace_uses(name, fused_name)  # same outputs, same indices
        g.remove(name)
        g.remove(qkv_use.src)
    return g
