"""Candidate builds in parallel worker processes: each job builds one point of a rule's space exactly as
compile does (`Rule.build_kernel`, prefetch injection included), compiles it with LLVM and exports a
shared library for the runner (here or on an RPC server) to load.

Workers are spawned once per builder and import TVM once (scripts that use a builder need the usual
`if __name__ == "__main__":` guard of spawned processes); a build that raises is a result with status
"build_error", and a job that kills its worker is found by rebuilding the unfinished jobs one by one.
Workers die with the process that started them (Linux): a tune killed mid-build leaves no compiler
running beside the next run's timings.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from ..schedules import KernelRequest


@dataclass(frozen=True)
class BuildJob:
    rule: str
    req: KernelRequest
    target: str  # preset name
    knobs: dict[str, int]
    prefetch: bool = True  # prefetch injection, as compile (--no-prefetch) has it

    def digest(self) -> str:
        doc = [self.rule, self.req.key(), self.target, sorted(self.knobs.items()), self.prefetch]
        return hashlib.sha1(json.dumps(doc).encode()).hexdigest()[:16]


@dataclass
class Built:
    job: BuildJob
    status: str  # "ok" or "build_error"
    path: str | None = None  # the exported library
    message: str = ""
    seconds: float = 0.0  # build time
    features: list[float] = field(default_factory=list)  # TIR features (features.py) of the kernel


def build_one(job: BuildJob, out_dir: str) -> Built:
    """Build, compile and export one candidate (runs in a worker, or inline)."""
    t0 = time.perf_counter()
    try:
        from ..compiler.tir_pipeline import compile_tir
        from ..schedules import rule_by_name
        from ..targets import get_preset
        from .features import tir_features

        rule, preset = rule_by_name(job.rule), get_preset(job.target)
        knobs = rule.resolve_knobs(job.req, preset, job.knobs)
        feats = tir_features(rule.build(job.req, preset, knobs))
        func = rule.build_kernel(job.req, preset, knobs, prefetch=job.prefetch)
        ex = compile_tir(func.with_attr("global_symbol", "kernel"), preset)
        path = os.path.join(out_dir, f"{job.digest()}.so")
        ex.export_library(path)
        return Built(job, "ok", path, "", time.perf_counter() - t0, feats)
    except Exception as e:  # noqa: BLE001 - a candidate's failure is its result
        return Built(job, "build_error", None, f"{type(e).__name__}: {e}", time.perf_counter() - t0)


def _warm(parent: int) -> None:
    _die_with(parent)
    import tvm  # noqa: F401

    from .. import schedules  # noqa: F401


def _die_with(parent: int) -> None:
    """SIGKILL this worker when the thread that spawned it exits (PR_SET_PDEATHSIG; builds are stateless). An
    orphan would go on compiling its queued jobs for minutes, on the cores the next timing run uses."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # it died before the request took effect
        os._exit(1)


class LocalBuilder:
    """Builds jobs on `workers` processes (0: in this process)."""

    def __init__(self, workers: int | None = None, out_dir: str | Path | None = None):
        self.workers = (os.cpu_count() or 1) if workers is None else workers
        self._tmp = None if out_dir else tempfile.TemporaryDirectory(prefix="ellm-tune-")
        self.out_dir = str(out_dir or self._tmp.name)
        self._pool = None

    def _executor(self) -> ProcessPoolExecutor:
        if self._pool is None:
            import multiprocessing as mp

            # spawn: a forked child would inherit TVM's thread pool in whatever state it is in
            self._pool = ProcessPoolExecutor(self.workers, mp_context=mp.get_context("spawn"), initializer=_warm,
                                             initargs=(os.getpid(),))
        return self._pool

    def build(self, jobs: Sequence[BuildJob]) -> list[Built]:
        if not self.workers:
            return [build_one(j, self.out_dir) for j in jobs]
        futures = [self._executor().submit(build_one, j, self.out_dir) for j in jobs]
        out: list[Built | None] = []
        for f in futures:
            try:
                out.append(f.result())
            except BrokenProcessPool:
                out.append(None)
        if any(b is None for b in out):  # a worker died (an LLVM abort, say): which job killed it is unknown,
            self._shutdown()             # so each unfinished job is rebuilt alone in a fresh worker
            out = [b if b is not None else self._alone(j) for b, j in zip(out, jobs)]
        return out  # type: ignore[return-value]

    def _alone(self, job: BuildJob) -> Built:
        import multiprocessing as mp

        with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), initializer=_warm,
                                 initargs=(os.getpid(),)) as pool:
            try:
                return pool.submit(build_one, job, self.out_dir).result()
            except BrokenProcessPool as e:
                return Built(job, "build_error", None, f"the build worker died building it: {e}")

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def close(self) -> None:
        self._shutdown()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __enter__(self) -> "LocalBuilder":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["BuildJob", "Built", "LocalBuilder", "build_one"]
