"""Merge matmuls that read the same input with the same weight format (Q+K+V, gate+up): one pass over x, one launch."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import replace

from ..pass_context import PassContext
from ..graph import Graph, OpKind, TensorType, VectorRef, WeightRef


def _fused_name(names: list[str]) -> str:
    """'blk.0.attn_q', 'blk.0.attn_k' -> 'blk.0.attn_q+attn_k'."""
    prefix = names[0].rsplit(".", 1)[0]
    if all(n.rsplit(".", 1)[0] == prefix for n in names):
        return prefix + "." + "+".join(n.rsplit(".", 1)[1] for n in names)
    return "+".join(names)


def _concatenated_rows(ws: list[WeightRef]) -> dict:
    """row_ids and source_rows of the row-concatenation of `ws` (none where every weight holds all its rows)."""
    if all(w.row_ids is None for w in ws):
        return {}
    ids: list[int] = []
    offset = 0
    for w in ws:
        if w.row_ids is not None and w.source_rows is None:
            raise AssertionError(f"{w.name}: fusing a row selection needs its source_rows")
        ids += [offset + r for r in w.selected_rows]
        offset += w.source_rows if w.row_ids is not None else w.rows
    return {"row_ids": tuple(ids), "source_rows": offset}


def fuse_sibling_matmuls(g: Graph, ctx: PassContext) -> Graph:
    g = g.copy()
    groups: dict[tuple, list[str]] = defaultdict(list)
    for name, op in g.nodes():
        if op.kind is OpKind.MATMUL and op.weight is not None:
            # Siblings must agree on everything but the weight rows (and bias values).
            key = (op.inputs, op.weight.qtype, op.weight.cols, op.weight.col_range, op.vector("bias") is not None,
                   op.attrs, op.layer)
            groups[key].append(name)
    for names in groups.values():
        if len(names) < 2:
            continue
        ops = [g.op(n) for n in names]
        first = ops[0]
        rows = sum(o.weight.rows for o in ops)
        name = _fused_name(names)
        weight = WeightRef(
            f"{name}.weight",
            first.weight.qtype,
            rows,
            first.weight.cols,
            tuple(s for o in ops for s in o.weight.sources),
            col_range=first.weight.col_range,
            **_concatenated_rows([o.weight for o in ops]),
        )
        vectors = tuple((r, v) for r, v in first.vectors if r != "bias")
        if first.vector("bias") is not None:
            bias_sources = tuple(s for o in ops for s in o.vector("bias").sources)
            vectors += (("bias", VectorRef(f"{name}.bias", rows, bias_sources)),)
        out = TensorType(first.out.shape[:-1] + (rows,), first.out.dtype)
        g.add(name, replace(first, outs=(out,), weights=(weight,), vectors=vectors))
        offset = 0
        for n, o in zip(names, ops):
            g.replace_uses(n, name, cols_offset=offset)
            offset += o.weight.rows
            g.remove(n)
    return g

