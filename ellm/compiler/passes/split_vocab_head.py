"""Store the output head as two row sets (likely tokens at the head's type, the rest coarser) when the precision
plan says so: two head matmuls read fewer bytes than one, and a merge puts the logits back in token order."""

from __future__ import annotations

from dataclasses import replace

from ..graph import Graph, OpKind, TensorType, Use, VectorRef, WeightRef
from ..pass_context import PassContext


def split_vocab_head(g: Graph, ctx: PassContext) -> Graph:
    split = ctx.precision.head_split if ctx.precision is not None else None
    if split is None:
        return g
    g = g.copy()
    (name,) = g.names(OpKind.LM_HEAD)
    head = g.op(name)
    w = head.weight
    (src,) = w.sources
    hot, cold = split.hot, split.cold_ids(w.rows)
    # index[token] = the token's position in hot ++ cold, the order the two matmuls write logits in
    index = [0] * w.rows
    for pos, tok in enumerate(hot + cold):
        index[tok] = pos
    parts = []
    for part, ids, qtype in (("hot", hot, w.qtype), ("cold", cold, split.cold)):
        ref = WeightRef(f"{src}.{part}", qtype, len(ids), w.cols, w.sources, w.layout, tuple(ids))
        out = TensorType(head.out.shape[:-1] + (len(ids),), head.out.dtype)
        parts.append(g.add(f"{name}.{part}", replace(head, outs=(out,), weights=(ref,))))
    merge = VectorRef(f"{name}.index", w.rows, (), "int32", tuple(index))
    g.add(f"{name}.merge", replace(head, kind=OpKind.VOCAB_MERGE, inputs=tuple(Use(p) for p in parts), weights=(),
                                    vectors=(("index", merge),), attrs=()))
    g.replace_uses(name, f"{name}.merge")
    g.remove(name)
    return g
