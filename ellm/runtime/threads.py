"""TVM's thread pool, sized per engine, with the calling thread kept off the workers' cores.

TVM pins each worker of its pool to one core (the first core left for the caller) and runs task 0 of
every parallel kernel on the calling thread, which it leaves free to run on any core. Linux then now and
then runs the caller on a worker's core: the two share that core while the caller's own idles, and
every kernel waits for its slower half. Pinning the caller to the cores no worker holds removes that.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from ..numa.topology import parse_cpu_list


def _parse_cpu_list(text: str) -> set[int]:
    """'0-3,6' -> {0, 1, 2, 3, 6} (the kernel's Cpus_allowed_list format)."""
    return set(parse_cpu_list(text))


_callers: set[int] = set()  # native ids of the threads pin_caller pinned: callers, not workers


def worker_cpus(task_dir: Path = Path("/proc/self/task"), caller: int | None = None,
                callers: set[int] = _callers) -> set[int]:
    """The CPUs that other threads of this process are pinned to, one CPU each: TVM's workers (every thread
    that launches kernels has a pool of its own), not the callers pinned here."""
    caller = threading.get_native_id() if caller is None else caller
    pinned: set[int] = set()
    try:
        tasks = list(task_dir.iterdir())
    except OSError:
        return pinned
    skip = {str(caller)} | {str(c) for c in callers}
    for t in tasks:
        if t.name in skip:
            continue
        try:
            status = (t / "status").read_text()
        except OSError:  # the thread ended meanwhile
            continue
        for line in status.splitlines():
            if line.startswith("Cpus_allowed_list:"):
                cpus = _parse_cpu_list(line.split(":", 1)[1])
                if len(cpus) == 1:
                    pinned |= cpus
    return pinned


def free_cpus(allowed: set[int], workers: set[int]) -> set[int]:
    """Where the caller should run: the allowed CPUs no worker holds (all of them if none is left)."""
    return (allowed - workers) or allowed


def pin_caller() -> None:
    """Keep the calling thread off the cores TVM's workers are pinned to (Linux; elsewhere nothing)."""
    if not hasattr(os, "sched_setaffinity"):
        return
    try:
        allowed = os.sched_getaffinity(0)
        target = free_cpus(allowed, worker_cpus())
        if target != allowed:
            os.sched_setaffinity(0, target)  # 0: the calling thread
            _callers.add(threading.get_native_id())
    except OSError:
        pass


_caller = threading.local()  # per calling thread: `threads`, the pool size it last configured (and was pinned for)


def set_threads(n: int) -> None:
    """Use `n` threads of TVM's pool for the following kernels, the caller running task 0 on its own core.

    Configuring the pool gives the caller every core again, so it is pinned after each configuration,
    once per calling thread."""
    import tvm

    if tvm.runtime.num_threads() != n or getattr(_caller, "threads", None) != n:
        tvm.get_global_func("runtime.config_threadpool")(1, n)
        pin_caller()
        _caller.threads = n
