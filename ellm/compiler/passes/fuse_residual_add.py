"""Fold a residual add into the matmul producing one operand: the matmul's epilogue adds it while storing."""

from __future__ import annotations

from dataclasses import replace

from ..pass_context import PassContext
from ..graph import Graph, OpKind


def fuse_residual_add(g: Graph, ctx: PassContext) -> Graph:
    g = g.copy()
    for name in g.names(OpKind.ADD):
        op = g.op(name)
        a, b = op.inputs
        for mm_use, res_use in ((b, a), (a, b)):
            mm = g.op(mm_use.src)
            if (
                mm.kind is OpKind.MATMUL
                and mm_use.cols is None
                and not mm.attr("residual", False)
                and g.consumers(mm_use.src) == [name]
                and mm_use.src not in g.outputs
            ):
                fused = replace(mm, inputs=mm.inputs + (res_use,)).with_attrs(residual=True)
                g.set_op(mm_use.src, fused)
                g.replace_uses(name, mm_use.src)
                g.remove(name)
                break
    return g
