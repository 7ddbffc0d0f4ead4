"""This machine's memory read bandwidth, measured with a multi-threaded streaming read kernel.

A decode step must read every weight and the KV cache once, so (bytes per token) / (this bandwidth)
is the fastest possible step. The kernel sums a buffer four times the size of the last-level cache (at least 512 MiB)
with AVX-512/AVX2 loads into independent accumulators, split into contiguous chunks over the threads.
It runs with and without software prefetch (`prefetchnta` at a few distances, as the decode kernels
use) and reports the fastest variant: the bound must be the best this machine can read, or the
"% of bandwidth" of a kernel that prefetches would flatter it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

LANES = 16
UNROLL = 4  # independent accumulators: loads, not add latency, are the limit


PREFETCH_BYTES = (0, 2048, 8192)  # variants tried; 0: hardware prefetch only


def read_kernel(n: int, tasks: int, prefetch_bytes: int = 0):
    from tvm.script import tirx as T

    from ..schedules.inject_prefetch import KEY, inject_prefetch

    chunk = n // tasks
    steps = chunk // (LANES * UNROLL)
    ann = {KEY: {"buffers": ["a"], "bytes": prefetch_bytes, "locality": 0}} if prefetch_bytes else {}

    @T.prim_func
    def read_bw(a: T.Buffer((n,), "float32"), out: T.Buffer((tasks, LANES), "float32")):
        T.func_attr({"tirx.noalias": True})
        for task in T.parallel(tasks):
            acc = T.alloc_buffer((UNROLL * LANES,), "float32")
            for i in T.vectorized(UNROLL * LANES):
                acc[i] = T.float32(0)
            for s in range(steps):
                for u in T.unroll(UNROLL, annotations=ann):
                    acc[T.ramp(u * LANES, 1, LANES)] = acc[T.ramp(u * LANES, 1, LANES)] + a[
                        T.ramp(task * chunk + (s * UNROLL + u) * LANES, 1, LANES)
                    ]
            for i in T.vectorized(LANES):
                out[task, i] = acc[i] + acc[LANES + i] + acc[2 * LANES + i] + acc[3 * LANES + i]

    return inject_prefetch(read_bw)


@dataclass(frozen=True)
class Bandwidth:
    gb_s_median: float
    gb_s_max: float
    gb_s_min: float
    bytes: int
    threads: int
    repeats: int
    prefetch_bytes: int  # of the fastest variant


def buffer_mb(llc_bytes: int) -> int:
    """MiB to stream: four times the last-level cache and at least 512, so that a cyclic read misses it."""
    return max(512, 4 * -(-llc_bytes // (1 << 20)))


def measure_read_bandwidth(threads: int, size_mb: int | None = None, repeats: int = 7, target=None) -> Bandwidth:
    """Streaming read GB/s (1e9 bytes/s) over a `size_mb` MiB buffer (default: `buffer_mb` of this host's L3)."""
    import tvm

    from ..compiler.tir_pipeline import compile_tir
    from ..runtime.threads import set_threads
    from ..targets import detect_host, resolve_target

    if size_mb is None:
        size_mb = buffer_mb(detect_host().caches.get("L3", 0))
    set_threads(threads)
    tasks = 64
    n = (size_mb << 20) // 4 // (tasks * LANES * UNROLL) * (tasks * LANES * UNROLL)
    preset = target or resolve_target("auto")
    a = tvm.runtime.tensor(np.ones(n, np.float32))
    out = tvm.runtime.tensor(np.zeros((tasks, LANES), np.float32))
    best = None
    for pf in PREFETCH_BYTES:
        ex = compile_tir(read_kernel(n, tasks, pf), preset)
        ex["read_bw"](a, out)  # warm-up: page in
        if not np.allclose(out.numpy().sum(), n):
            raise AssertionError("bandwidth kernel summed wrong")
        timer = ex.mod.time_evaluator("read_bw", tvm.cpu(), number=1, repeat=repeats)
        rates = [4 * n / t / 1e9 for t in timer(a, out).results]
        bw = Bandwidth(statistics.median(rates), max(rates), min(rates), 4 * n, threads, repeats, pf)
        if best is None or bw.gb_s_median > best.gb_s_median:
            best = bw
    return best
