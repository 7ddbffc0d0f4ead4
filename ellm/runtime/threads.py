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

from ..numa.topology import allowed_cpus, parse_cpu_list


def _parse_cpu_list(text: str) -> set[int]:
    """'0-3,6' -> {0, 1, 2, 3, 6} (the kernel's Cpus_allowed_list format)."""
    return set(parse_cpu_list(text))


_callers: set[int] = set()  # native ids of the threads that configured a pool: callers, not workers


def worker_cpus(task_dir: Path = Path("/proc/self/task"), caller: int | None = None,
                callers: set[int] = _callers) -> set[int]:
    """The CPUs that other threads of this process are pinned to, one CPU each: TVM's workers (every thread
    that launches kernels has a pool of its own), not the callers pinned here."""
    caller = threading.get_native_id() if caller is None else caller
    skip = {caller} | set(callers)
    return {c for tid, cpus in thread_affinities(task_dir).items() if tid not in skip and len(cpus) == 1 for c in cpus}


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


_caller = threading.local()  # per calling thread: `config`, the (threads, CPUs) it last configured (and was pinned for)


SPECIFY_ONE_CORE_PER_THREAD = -2  # TVM's ThreadGroup::kSpecifyOneCorePerThread: worker i pinned to cpus[i]


def set_threads(n: int, cpus: tuple[int, ...] | None = None) -> None:
    """Use `n` threads of TVM's pool for the following kernels, the caller running task 0 on its own core.

    Without `cpus`, TVM pins its workers (to the machine's first cores, whatever the process's affinity mask)
    and the caller is kept off their cores. With `cpus` ([task] -> CPU, numa/threadmap.py), worker i runs on
    cpus[i] and the caller on cpus[0]. Configuring the pool gives the caller every core again, so it is
    pinned after each configuration, once per calling thread."""
    import tvm

    key = (n, tuple(cpus) if cpus is not None else None)
    previous = getattr(_caller, "config", None)
    if tvm.runtime.num_threads() != n or previous != key:
        config = tvm.get_global_func("runtime.config_threadpool")
        if cpus is None:
            if previous is not None and previous[1] is not None:
                # TVM's own mode keeps workers where a CPU list put them: put them back where it pins them
                # (worker i on the i-th CPU), or other callers would find no core free of workers
                default = sorted(allowed_cpus())[:n]
                if len(default) == n:
                    config(SPECIFY_ONE_CORE_PER_THREAD, n, [str(c) for c in default])
            config(1, n)
            pin_caller()
            _callers.add(threading.get_native_id())  # a caller, never a worker, wherever TVM left it pinned
        else:
            if len(cpus) != n:
                raise ValueError(f"{n} threads need {n} CPUs, got {len(cpus)}")
            config(SPECIFY_ONE_CORE_PER_THREAD, n, [str(c) for c in cpus])
            if hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, {cpus[0]})  # 0: the calling thread
                _callers.add(threading.get_native_id())
        _caller.config = key


def thread_affinities(task_dir: Path = Path("/proc/self/task")) -> dict[int, tuple[int, ...]]:
    """Every thread of this process (native id) -> the CPUs it may run on."""
    out = {}
    try:
        tasks = list(task_dir.iterdir())
    except OSError:
        return out
    for t in tasks:
        try:
            for line in (t / "status").read_text().splitlines():
                if line.startswith("Cpus_allowed_list:"):
                    out[int(t.name)] = parse_cpu_list(line.split(":", 1)[1])
        except OSError:  # the thread ended meanwhile
            continue
    return out
