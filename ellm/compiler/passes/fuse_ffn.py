"""Fuse the feed-forward block (gate+up matmul, SiLU * mul, down matmul + residual) into one kernel:
the intermediate activations stay inside it, quantised once, and two launches disappear."""

from __future__ import annotations


from ..graph import Graph, Op, OpKind, Use, attrs
from ..pass_context import PassContext


def fuse_ffn(g: Graph, ctx: PassContext) -> Graph:
    g = g.copy()
    if not ctx.target.isa is not None or not ctx.integer:
        return g  # the fused kernel is written for the integer path
    for name in g.names(OpKind.SILU_MUL):
        s = g.op(name)
        gate, up = s.inputs
        gu_name = gate.src
        if up.src != gu_name or g.consumers(gu_name) != [name]:
            continue
        gu = g.op(gu_name)
        F = s.out.width
        if gu.kind is not OpKind.MATMUL or gate.cols != (0, F) or up.cols != (F, 2 * F) or gu.vector("norm") is None:
            continue
        users = g.consumers(name)
        if len(users) != 1:
            continue
        dn = g.op(users[0])
        if dn.kind is not OpKind.MATMUL or not dn.attr("residual") or dn.inputs[0] != Use(name) or dn.vectors:
            continue
        (x,) = gu.inputs
        if dn.inputs[1] != x or gu.vector("bias") is not None or x.cols is not None:
            continue
        if any(w.layout != "tile16" for w in (gu.weight, dn.weight)) or F % 32:
            continue
        fused = Op(
            OpKind.FFN,
            dn.outs,
            (x,),
            weights=(gu.weight, dn.weight),
            vectors=(("norm", gu.vector("norm")),),
            attrs=attrs(norm_eps=gu.attr("norm_eps"), act_bits=gu.attr("act_bits"),
                        chunk_act_bits=gu.attr("chunk_act_bits"), d_ff=F),
            layer=dn.layer,
        )
        ffn_name = gu_name.rsplit(".", 1)[0] + ".ffn"
        g.add(ffn_name, fused)
        g.replace_uses(users[0], ffn_name)
        for n in (users[0], name, gu_name):
            g.remove(n)
    return g


