"""Inject software prefetches into loops a schedule annotated with `ellm.prefetch`.

A rule marks the loop that streams a buffer (`{"buffers": [...], "bytes": D, "locality": L}`); this pass
puts, at the top of that loop's body, one prefetch of address + D bytes for every distinct load of those
buffers in the body. Locality 0 emits `prefetchnta`, 3 `prefetcht0`. Disabled, it only drops the
annotation, so the same kernel compiles with and without prefetch (`ellm compile --no-prefetch`).
x86 prefetches never fault, so addresses past the end of a buffer are harmless.
"""

from __future__ import annotations

import tvm
import tvm_ffi
from tvm import tirx

from tvm.ir.expr import TensorLoad
from tvm.ir.prim.expr import Ramp

from .tir_walk import loads, rewrite_loops

KEY = "ellm.prefetch"


def _shifted(load: TensorLoad, nbytes: int):
    """The same load `nbytes` further on in the buffer's row-major memory (scalar: a vector's first lane)."""
    itemsize = tvm.DataType(str(load.source.dtype)).bits // 8
    *lead, last = load.indices
    if isinstance(last, Ramp):
        last = last.base
    return tirx.BufferLoad(load.source, [*lead, last + nbytes // itemsize])


def _prefetch(load: TensorLoad, nbytes: int, locality: int) -> tirx.Stmt:
    addr = tirx.address_of(_shifted(load, nbytes))
    return tirx.Evaluate(tirx.call_llvm_intrin("void", "llvm.prefetch.p0", addr, 0, locality, 1))


def inject_prefetch(func: tirx.PrimFunc, enabled: bool = True) -> tirx.PrimFunc:
    def rewrite(loop: tirx.For) -> tirx.Stmt:
        if KEY not in loop.annotations:
            return loop
        spec = loop.annotations[KEY]
        others = {k: v for k, v in loop.annotations.items() if k != KEY}
        body = loop.body
        if enabled:
            names = {str(b) for b in spec["buffers"]}
            distinct: dict[int, TensorLoad] = {}
            for ld in loads(body):
                if ld.source.name in names:
                    distinct.setdefault(tvm_ffi.structural_hash(ld), ld)
            pfs = [_prefetch(ld, int(spec["bytes"]), int(spec["locality"])) for ld in distinct.values()]
            body = tirx.SeqStmt([*pfs, body]) if pfs else body
        return tirx.For(loop.loop_var, loop.min, loop.extent, loop.kind, body, loop.thread_binding, others, loop.step)

    return func.with_body(rewrite_loops(func.body, rewrite))
