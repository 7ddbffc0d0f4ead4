"""Minimal TIR traversal for eLLM's own passes (TVM 0.27 no longer exposes stmt_functor to Python).

`loads` walks statements and expressions for buffer loads; `rewrite_loops` rebuilds the statement tree
with a function applied to every For loop (post-order). It rebuilds the statement kinds of the kernels
eLLM writes directly (tirx dialect); scheduled s_tir blocks are returned unchanged: they come from TE
compute definitions, which never carry eLLM's loop annotations.
"""

from __future__ import annotations

from typing import Callable, Iterator

from tvm import tirx
from tvm.ir.expr import Expr, TensorLoad

_EXPR_FIELDS = ("a", "b", "value", "args", "base", "stride", "condition", "true_value", "false_value", "vectors", "indices")


def _children(node) -> Iterator:
    for f in _EXPR_FIELDS:
        v = getattr(node, f, None)
        if v is None:
            continue
        if isinstance(v, (list, tuple)) or type(v).__name__ == "Array":
            yield from v
        else:
            yield v


def loads(node, out: list | None = None) -> list[TensorLoad]:
    """Every buffer load under a statement or expression, in visit order (`load.source` is the buffer)."""
    out = [] if out is None else out
    if isinstance(node, TensorLoad):
        out.append(node)
    if isinstance(node, tirx.SeqStmt):
        for s in node.seq:
            loads(s, out)
        return out
    if isinstance(node, (tirx.For, tirx.AttrStmt, tirx.While)):
        loads(node.body, out)
        return out
    if isinstance(node, tirx.IfThenElse):
        loads(node.condition, out)
        loads(node.then_case, out)
        if node.else_case is not None:
            loads(node.else_case, out)
        return out
    for child in _children(node):
        if isinstance(child, (Expr, tirx.Stmt)):
            loads(child, out)
    return out


def rewrite_loops(stmt: tirx.Stmt, fn: Callable[[tirx.For], tirx.Stmt]) -> tirx.Stmt:
    """Rebuild `stmt` bottom-up, replacing every For loop `f` (after its body is rewritten) by fn(f)."""
    if isinstance(stmt, tirx.SeqStmt):
        return tirx.SeqStmt([rewrite_loops(s, fn) for s in stmt.seq])
    if isinstance(stmt, tirx.For):
        body = rewrite_loops(stmt.body, fn)
        loop = tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body, stmt.thread_binding, stmt.annotations, stmt.step)
        return fn(loop)
    if isinstance(stmt, tirx.IfThenElse):
        els = rewrite_loops(stmt.else_case, fn) if stmt.else_case is not None else None
        return tirx.IfThenElse(stmt.condition, rewrite_loops(stmt.then_case, fn), els)
    if isinstance(stmt, tirx.AttrStmt):
        return tirx.AttrStmt(stmt.node, stmt.attr_key, stmt.value, rewrite_loops(stmt.body, fn))
    if isinstance(stmt, tirx.While):
        return tirx.While(stmt.condition, rewrite_loops(stmt.body, fn))
    return stmt
