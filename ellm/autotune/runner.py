"""Run built candidates on this machine: check each against the kernel's default on the same inputs, then
time it with the harness of measure.py.

The check is differential: points of a speed-search space change how a kernel runs, not what it computes,
so after one call from the same state every buffer a candidate writes must match the default's (floats to
a summation-order tolerance, everything else exactly). The defaults themselves are checked against
float64 references by the test suite, and random points of every space too (tests/test_space_numerics.py).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import numpy as np

from ..schedules import KernelRequest, rule_by_name
from ..targets import get_preset
from .builder import Built
from .measure import (Workload, calls_for, inputs, kv_read_bytes, kv_steps, last_level_cache, param_names, reuse_bytes,
                      streamed, tensor_bytes, time_passes, timing_sets, weight_bytes)

WARMUP_PASSES = 3  # discarded timed passes of a new bench, before its first timing (KernelBench.time)
RTOL = 2e-3  # of the largest magnitude of a float output: split-K merges and tiling reorder float sums


@dataclass
class Trial:
    status: str  # ok, build_error, run_error, wrong
    seconds: float | None = None  # median per call
    stats: dict[str, float] = field(default_factory=dict)  # median, min, max (seconds), passes, calls
    message: str = ""
    runner: str = "local"  # where it ran: local, or rpc:<key>@<server>

    @classmethod
    def from_record(cls, r) -> "Trial":
        """The trial a database record (`TuningRecord`) holds, for a search to resume from or a sweep to replay."""
        return cls(r.status, r.seconds if r.status == "ok" else None, dict(r.stats), r.message)


def mismatch(got: list[np.ndarray], want: list[np.ndarray]) -> str:
    """'' when every buffer matches, else which one differs and by how much."""
    for i, (g, w) in enumerate(zip(got, want)):
        if g.dtype.kind == "f":
            g64, w64 = g.astype(np.float64), w.astype(np.float64)
            if not np.array_equal(np.isfinite(g64), np.isfinite(w64)) or not np.array_equal(g64[np.isinf(w64)], w64[np.isinf(w64)]):
                return f"argument {i}: NaN or infinity where the default has a number (or the reverse)"
            finite = np.isfinite(w64)
            scale = float(np.abs(w64[finite]).max()) if finite.any() else 0.0
            err = float(np.abs(g64[finite] - w64[finite]).max()) if finite.any() else 0.0
            if err > RTOL * scale + 1e-6:
                return f"argument {i}: off by {err:.3g} (largest value {scale:.3g})"
        elif not np.array_equal(g, w):
            return f"argument {i}: {int((g != w).sum())} elements differ"
    return ""


def call_bytes(func, req: KernelRequest, args, wl: Workload) -> int:
    """Bytes one call streams: its packed weights; for attention, the blocks a query reads of one layer's
    cache (kv_read_bytes); for other kernels of the KV cache, one layer's share of what they are given."""
    w = weight_bytes(func, args)
    if w or "layer" not in param_names(func):
        return w
    read = kv_read_bytes(req, wl)
    if read is not None:
        return read
    state = sum(tensor_bytes(args[i]) for i in streamed(func, args))
    return state // max(1, len(kv_steps(req, wl.layers)))


def kernel_key(job) -> str:
    """What a KernelBench (inputs, reference outputs, timing sets) is made for: the job's kernel on its target."""
    return job.req.key() + job.rule + job.target


class KernelBench:
    """One kernel's inputs, its default's outputs and the timing sets, made once for all its candidates."""

    def __init__(self, rule: str, req: KernelRequest, target: str, wl: Workload):
        import tvm

        preset = get_preset(target)
        r = rule_by_name(rule)
        self.func = r.build(req, preset, r.default_knobs(req, preset))  # parameters are the same for every point
        self.req, self.wl = req, wl
        self.args = inputs(self.func, req, wl, np.random.default_rng(0))
        self.initial = [a.numpy() if isinstance(a, tvm.runtime.Tensor) else a for a in self.args]
        self.cold = req.m == 1  # one-token: timed at the step's reuse distance (measure.reuse_bytes), else hot
        self.reuse = reuse_bytes(wl, last_level_cache()) if self.cold else 0  # what timing_sets rotates through
        self.bytes = call_bytes(self.func, req, self.args, wl)
        self.sets = None
        self._scratch: list | None = None
        self.reference: list[np.ndarray] | None = None

    def once(self, f) -> list[np.ndarray]:
        """Every buffer after one call from the initial state."""
        import tvm

        # One scratch set, refilled for each candidate: a newly loaded module keeps the arguments of its
        # first call alive (27 MB a candidate for the LM head, 14 GB over a sweep), so they must be reused.
        if self._scratch is None:
            self._scratch = [tvm.runtime.tensor(a) if isinstance(a, np.ndarray) else a for a in self.initial]
        for t, a in zip(self._scratch, self.initial):
            if isinstance(a, np.ndarray):
                t.copyfrom(a)
        f(*self._scratch)
        return [t.numpy() for t in self._scratch if isinstance(t, tvm.runtime.Tensor)]

    def time(self, f) -> dict[str, float]:
        calls = calls_for(self.req, self.cold)
        if self.sets is None:
            self.sets = timing_sets(self.func, self.req, self.args, self.wl, self.cold)
            # Freshly allocated timing sets time slow at first (Zen 4 VM: the LM head's default 1105 us,
            # then 754, then 620-740), and the first candidate timed is the default every result is
            # measured against: one discarded timing of the same calls first.
            time_passes(f, self.sets, calls, passes=WARMUP_PASSES)
        t = time_passes(f, self.sets, calls)
        # method and reuse say how it was timed: "rotate" rereads a byte only after `reuse` bytes of
        # others (measure.reuse_bytes) through `sets` argument sets; "hot", one set, in the caches
        return {"median": statistics.median(t), "min": min(t), "max": max(t), "passes": len(t), "calls": calls,
                "bytes": self.bytes, "method": "rotate" if self.cold else "hot",
                "reuse": self.reuse, "sets": len(self.sets)}


class LocalRunner:
    """Checks and times built candidates here, one at a time (timings must not overlap)."""

    name = "local"

    def __init__(self, workload: Workload = Workload()):
        self.workload = workload
        self._benches: dict[str, KernelBench] = {}

    def bench(self, built: Built) -> KernelBench:
        j = built.job
        key = kernel_key(j)
        if key not in self._benches:
            self._benches = {key: KernelBench(j.rule, j.req, j.target, self.workload)}  # one kernel at a time
        return self._benches[key]

    def run_many(self, builts, defaults) -> list[Trial]:
        return [self.run(b, d) for b, d in zip(builts, defaults)]

    def run(self, built: Built, is_default: bool = False) -> Trial:
        import tvm

        if built.status != "ok":
            return Trial(built.status, message=built.message)
        try:
            b = self.bench(built)
            f = tvm.runtime.load_module(built.path)["kernel"]
            out = b.once(f)
            if is_default or b.reference is None:
                b.reference = out
            else:
                bad = mismatch(out, b.reference)
                if bad:
                    return Trial("wrong", message=f"differs from the default: {bad}")
            stats = b.time(f)
        except Exception as e:  # noqa: BLE001 - a crash of a candidate is its result
            return Trial("run_error", message=f"{type(e).__name__}: {e}")
        return Trial("ok", stats["median"], stats)


__all__ = ["KernelBench", "LocalRunner", "Trial", "kernel_key", "mismatch"]
