"""Features of a kernel's TIR for the cost model: what it moves and how its loops run, read from the PrimFunc
a rule builds (before LLVM), so a candidate is described without compiling it.

Loop extents that are not constants (token counts, context length) count as 1: the features compare
candidates of one request, whose run-time sizes are the same.
"""

from __future__ import annotations

import functools
import math

import tvm
from tvm import tirx
from tvm.ir.expr import Call, TensorLoad

from ..schedules.tir_walk import loads

NAMES = (
    "log_bytes_loaded",  # bytes of every load times its loops' trip counts
    "log_bytes_stored",
    "log_loads",  # load instructions executed
    "max_vector_bytes",  # widest load
    "parallel_extent",  # tasks of the parallel loops (summed over parallel loops)
    "max_loop_depth",
    "log_innermost_trips",  # trip count of the deepest loop nest
    "inner_body_loads",  # loads in the body of the deepest loop (unrolling makes it grow)
    "log_prefetches",  # prefetch instructions executed
    "prefetch_bytes",  # the largest annotated prefetch distance
)


@functools.lru_cache(maxsize=1)
def _prefetch_id() -> str:
    """How TIR spells llvm.prefetch's intrinsic id (call_llvm_intrin's first argument)."""
    return str(tirx.call_llvm_intrin("void", "llvm.prefetch.p0", tirx.const(0, "int64"), 0, 0, 1).args[0])


def _extent(loop: tirx.For) -> int:
    e = loop.extent
    return int(e.value) if isinstance(e, tirx.IntImm) else 1


def _bytes(dtype) -> int:
    t = tvm.DataType(str(dtype))
    return t.bits * t.lanes // 8


class _Walk:
    def __init__(self):
        self.loaded = self.stored = self.n_loads = 0.0
        self.max_vec = 0
        self.parallel = 0
        self.depth = 0
        self.inner_trips = 1
        self.inner_loads = 0
        self.prefetches = 0
        self.prefetch_bytes = 0

    def expr_loads(self, node, trips: int) -> int:
        found = [ld for ld in loads(node) if isinstance(ld, TensorLoad)]
        for ld in found:
            nb = _bytes(ld.ty.dtype) if hasattr(ld, "ty") else _bytes(ld.source.dtype)
            self.loaded += nb * trips
            self.n_loads += trips
            self.max_vec = max(self.max_vec, nb)
        return len(found)

    def stmt(self, s, trips: int, depth: int) -> int:
        """Walk `s` executed `trips` times at loop depth `depth`; returns the loads directly in it."""
        if isinstance(s, tirx.SeqStmt):
            return sum(self.stmt(x, trips, depth) for x in s.seq)
        if isinstance(s, tirx.For):
            n = _extent(s)
            if s.kind == tirx.ForKind.PARALLEL:
                self.parallel += n
            spec = s.annotations.get("ellm.prefetch") if s.annotations else None
            if spec is not None:
                self.prefetch_bytes = max(self.prefetch_bytes, int(spec["bytes"]))
            inner = self.stmt(s.body, trips * n, depth + 1)
            if depth + 1 > self.depth or (depth + 1 == self.depth and trips * n > self.inner_trips):
                self.depth, self.inner_trips, self.inner_loads = depth + 1, trips * n, inner
            return 0
        if isinstance(s, tirx.IfThenElse):
            c = self.expr_loads(s.condition, trips) + self.stmt(s.then_case, trips, depth)
            return c + (self.stmt(s.else_case, trips, depth) if s.else_case is not None else 0)
        if isinstance(s, tirx.BufferStore):
            self.stored += _bytes(s.value.ty.dtype) * trips if hasattr(s.value, "ty") else 0
            return self.expr_loads(s.value, trips) + sum(self.expr_loads(i, trips) for i in s.indices)
        if isinstance(s, tirx.Evaluate):
            v = s.value
            if isinstance(v, Call) and v.args and str(v.args[0]) == _prefetch_id():
                self.prefetches += trips
            return self.expr_loads(v, trips)
        n = 0
        for f in ("value", "condition"):
            if getattr(s, f, None) is not None and not isinstance(getattr(s, f), tirx.Stmt):
                n += self.expr_loads(getattr(s, f), trips)
        if getattr(s, "body", None) is not None:
            n += self.stmt(s.body, trips, depth)
        return n


def tir_features(func: tirx.PrimFunc) -> list[float]:
    """The NAMES features of a kernel, in that order."""
    w = _Walk()
    w.stmt(func.body, 1, 0)
    lg = lambda x: math.log2(1.0 + x)  # noqa: E731
    return [lg(w.loaded), lg(w.stored), lg(w.n_loads), float(w.max_vec), float(w.parallel), float(w.depth),
            lg(w.inner_trips), float(w.inner_loads), lg(w.prefetches), float(w.prefetch_bytes)]


__all__ = ["NAMES", "tir_features"]
