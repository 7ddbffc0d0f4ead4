"""Rotate Q and K, append K and V to the cache and emit rotated Q in one kernel reading the fused QKV output once."""

from __future__ import annotations

from dataclasses import replace

from ..pass_context import PassContext
from ..graph import Graph, Op, OpKind, Use, attrs


def fuse_rope_kv_append(g: Graph, ctx: PassContext) -> Graph:
    g = g.copy()
    for name in g.names(OpKind.KV_APPEND):
        op = g.op(name)
        cache_in, k_use, v_use = op.inputs
        k_rope = g.op(k_use.src)
        attns = [c for c in g.consumers(name) if g.op(c).kind is OpKind.ATTENTION]
        if k_rope.kind is not OpKind.ROPE or k_use.cols or len(attns) != 1:
            continue
        attn_name = attns[0]
        attn = g.op(attn_name)
        q_use, _ = attn.inputs
        q_rope = g.op(q_use.src)
        if q_rope.kind is not OpKind.ROPE or q_use.cols:
            continue
        (q_src,), (k_src,) = q_rope.inputs, k_rope.inputs
        producer = q_src.src
        if not (k_src.src == v_use.src == producer and None not in (q_src.cols, k_src.cols, v_use.cols)):
            continue
        # The producer must hold exactly [q | k | v] in that order (a fused QKV matmul).
        qd, kd = q_rope.out.width, k_rope.out.width
        width = g.op(producer).out.width
        if (q_src.cols, k_src.cols, v_use.cols) != ((0, qd), (qd, qd + kd), (qd + kd, qd + 2 * kd)) or width != qd + 2 * kd:
            continue
        if g.consumers(q_use.src) != [attn_name] or g.consumers(k_use.src) != [name]:
            continue
        if q_rope.attr("neox") != k_rope.attr("neox") or q_rope.attr("rope_dim") != k_rope.attr("rope_dim"):
            continue
        fused_name = name.replace("kv_append", "rope_kv_append")
        fused = Op(
            OpKind.ROPE_KV_APPEND,
            (q_rope.out, op.out),  # (rotated q [T, q_dim], updated cache)
            (cache_in, Use(producer)),
            attrs=attrs(
                n_heads=q_rope.attr("n_heads"),
                n_kv_heads=k_rope.attr("n_heads"),
                neox=q_rope.attr("neox"),
                rope_dim=q_rope.attr("rope_dim"),
            ),
            layer=op.layer,
        )
        g.add(fused_name, fused)
        g.set_op(attn_name, replace(attn, inputs=(Use(fused_name, index=0), Use(fused_name, index=1))))
        g.replace_uses(name, fused_name, index=1)  # later layers read the updated cache
        for n in (name, q_use.src, k_use.src):
            g.remove(n)
    return g

