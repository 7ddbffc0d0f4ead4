"""Keep one tensor-parallel rank's slice of the model (parallel/shard.py) and join the ranks where a slice ends:
an all-reduce after the vocabulary-parallel embedding and after each row-parallel matmul, an all-gather of the
logits."""

from __future__ import annotations

from dataclasses import replace

from ...errors import EllmError
from ..graph import Graph, Op, OpKind, TensorType, Use, WeightRef, attrs
from ..pass_context import PassContext


def _rows(w: WeightRef, lo: int, hi: int, name: str | None = None) -> WeightRef:
    """Rows [lo, hi) of a weight holding all its rows."""
    return replace(w, name=name or w.name, rows=hi - lo, row_ids=tuple(range(lo, hi)), source_rows=w.rows)


def _cols(w: WeightRef, lo: int, hi: int) -> WeightRef:
    """Columns [lo, hi) of every row (a row-parallel slice): cut at the format's blocks, or refused."""
    try:
        return replace(w, cols=hi - lo, col_range=(lo, hi))
    except ValueError as e:
        raise EllmError(f"tensor parallelism cannot cut {w.sources[0]} ({w.qtype.name}) at columns {lo}, {hi}: "
                        "not a block boundary of its format") from e


def _width(t: TensorType, width: int) -> TensorType:
    return TensorType(t.shape[:-1] + (width,), t.dtype)


def shard_tensor_parallel(g: Graph, ctx: PassContext) -> Graph:
    tp = ctx.tensor_parallel
    if tp is None:
        return g
    g = g.copy()
    L, Hkv, C, hd = g.op("kv_cache").out.shape
    # [n_layers, rank's KV heads, ctx, head_dim]
    cache_t = TensorType((L, tp.n_kv_heads, C, hd), g.op("kv_cache").out.dtype)
    q0, q1 = (h * int(hd) for h in tp.q_heads)
    k0, k1 = (h * int(hd) for h in tp.kv_heads)
    f0, f1 = tp.ff
    v0, v1 = tp.vocab
    row_slices = {"attn_q": (q0, q1), "attn_k": (k0, k1), "attn_v": (k0, k1), "ffn_gate": (f0, f1),
                  "ffn_up": (f0, f1)}
    col_slices = {"attn_output": (q0, q1), "ffn_down": (f0, f1)}
    for name in g.names():
        op = g.op(name)
        role = name.rsplit(".", 1)[-1]
        if op.kind is OpKind.EMBEDDING:
            # vocabulary-parallel: this rank's rows of the table (tied: the very weight its head rows are), zero
            # rows for the other ranks' tokens, and the all-reduce puts every token's row together
            w = _rows(op.weight, v0, v1, name=f"{op.weight.name}.rows{v0}-{v1}")
            g.set_op(name, replace(op, weights=(w,)).with_attrs(first_row=v0))
            g.insert_after(name, f"{name}.allreduce", Op(OpKind.ALLREDUCE, op.outs, (Use(name),)))
        elif op.kind is OpKind.INPUT and name == "kv_cache":
            g.set_op(name, replace(op, outs=(cache_t,)))
        elif op.kind is OpKind.MATMUL and role in row_slices:
            w = _rows(op.weight, *row_slices[role])
            g.set_op(name, replace(op, outs=(_width(op.out, w.rows),), weights=(w,)))
        elif op.kind is OpKind.MATMUL and role in col_slices:
            g.set_op(name, replace(op, weights=(_cols(op.weight, *col_slices[role]),)))
            # [T, d_model]: this rank's partial sum -> the sum over ranks
            g.insert_after(name, f"{name}.allreduce", Op(OpKind.ALLREDUCE, op.outs, (Use(name),), layer=op.layer))
        elif op.kind is OpKind.ROPE:
            heads = tp.n_heads if role == "rope_q" else tp.n_kv_heads
            g.set_op(name, replace(op, outs=(_width(op.out, heads * int(hd)),)).with_attrs(n_heads=heads))
        elif op.kind is OpKind.KV_APPEND:
            g.set_op(name, replace(op, outs=(cache_t,)))
        elif op.kind is OpKind.ATTENTION:
            g.set_op(name, replace(op, outs=(_width(op.out, q1 - q0),)).with_attrs(n_heads=tp.n_heads))
        elif op.kind is OpKind.SILU_MUL:
            g.set_op(name, replace(op, outs=(_width(op.out, f1 - f0),)))
        elif op.kind is OpKind.LM_HEAD:
            w = _rows(op.weight, v0, v1, name=f"{op.weight.name}.rows{v0}-{v1}")
            g.set_op(name, replace(op, outs=(_width(op.out, w.rows),), weights=(w,)))
            # [T, vocab]: every rank's logits in rank order
            g.insert_after(name, f"{name}.allgather", Op(OpKind.ALLGATHER, (op.out,), (Use(name),),
                                                         attrs=attrs(widths=tp.vocab_widths)))
        elif op.kind in (OpKind.VOCAB_MERGE, OpKind.FFN, OpKind.ATTN_INPUT, OpKind.ROPE_KV_APPEND):
            raise EllmError(f"tensor parallelism shards the unfused graph; it cannot split {op.kind.value} ({name})")
    g.set_meta("tensor_parallel", tp.to_dict())
    g.check()
    return g
