"""Fold an RMSNorm into the matmuls that consume it: the normalised activations never go to memory."""

from __future__ import annotations

from dataclasses import replace

from ..pass_context import PassContext
from ..graph import Graph, OpKind, Use

_MATMULS = (OpKind.MATMUL, OpKind.LM_HEAD)


def fuse_rmsnorm_matmul(g: Graph, ctx: PassContext) -> Graph:
    g = g.copy()
    for name in g.names(OpKind.RMSNORM):
        op = g.op(name)
        users = [g.op(c) for c in g.consumers(name)]
        if not users or name in g.outputs:
            continue
        if not all(
            u.kind in _MATMULS and u.vector("norm") is None and u.inputs == (Use(name),) for u in users
        ):
            continue
        (src,) = op.inputs
        for c in g.consumers(name):
            u = g.op(c)
            fused = replace(u, inputs=(src,), vectors=(("norm", op.vector("norm")),) + u.vectors)
            g.set_op(c, fused.with_attrs(norm_eps=op.attr("eps")))
        g.remove(name)
    return g
