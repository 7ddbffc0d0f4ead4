"""TVM Disco sessions for a tensor-parallel group: importing Disco as this wheel needs, starting worker processes
whose pipes eLLM keeps, and disarming a session whose worker died (docs/disco-cpu-notes.md has the findings)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

POOL_FUNC = "ellm.parallel.create_process_pool"


def disco_module():
    """(tvm.runtime.disco, its FFI table). In TVM 0.27's wheel its first import runs before the library holding Disco is loaded,
    leaving `tvm.runtime.disco` None and its FFI table empty: fill the table again, then import."""
    import importlib

    import tvm  # noqa: F401 (loads libtvm_runtime_extra, which holds Disco)
    import tvm_ffi

    api = importlib.import_module("tvm.runtime.disco._ffi_api")
    if not hasattr(api, "SessionProcess"):
        tvm_ffi.init_ffi_api("runtime.disco", "tvm.runtime.disco._ffi_api")
    return importlib.import_module("tvm.runtime.disco"), api


@dataclass
class WorkerPool:
    """Disco's worker processes 1..N-1 and the driver's ends of their pipes."""

    workers: list[Any] = field(default_factory=list)  # tvm's DiscoPopenWorker, one per process
    pipes: dict[int, tuple[int, int]] = field(default_factory=dict)  # worker id -> (read fd, write fd)

    def pids(self) -> list[int]:
        return [w._proc.pid for w in self.workers if w._proc is not None]

    def dead(self) -> list[tuple[int, int]]:
        """(worker id, pid) of the worker processes that have exited."""
        return [(i + 1, w._proc.pid) for i, w in enumerate(self.workers)
                if w._proc is not None and w._proc.poll() is not None]

    def disarm(self, grace_s: float = 0.0) -> None:
        """Stop every worker process (after `grace_s` to exit by itself, then killed) and point the driver's pipe
        ends at /dev/null. Whatever the session still writes then goes nowhere: a shutdown after a failure, or a
        register freed after shutdown (a DRef's destructor broadcasts to every worker). Written to a pipe whose
        worker is gone, either throws in a destructor, which aborts the process."""
        deadline = time.monotonic() + grace_s
        for w in self.workers:
            if w._proc is not None:
                try:
                    w._proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    pass
        for pid in self.pids():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        for w in self.workers:
            if w._proc is not None:
                w._proc.wait()
        null_w = os.open(os.devnull, os.O_WRONLY)
        null_r = os.open(os.devnull, os.O_RDONLY)
        for r, w in self.pipes.values():
            os.dup2(null_w, w)
            os.dup2(null_r, r)
        os.close(null_w)
        os.close(null_r)


_started: list[WorkerPool] = []  # filled by the pool function while a session is being constructed


def _register_pool() -> None:
    import tvm_ffi
    from tvm.runtime.disco.process_pool import DiscoPopenWorker
    from tvm_ffi import Shape

    def create(num_workers: int, num_groups: int, entrypoint: str):
        pool = WorkerPool([DiscoPopenWorker(i, num_workers, num_groups, entrypoint) for i in range(1, num_workers)])
        _started.append(pool)

        def start(worker_id: int):
            if worker_id == 0:
                return None
            r, w = pool.workers[worker_id - 1].start()
            pool.pipes[worker_id] = (r, w)
            return Shape([r, w])

        return start

    tvm_ffi.register_global_func(POOL_FUNC, create, override=True)


def start_session(world: int, entrypoint: str):
    """(a Disco ProcessSession of `world` workers running `python -m entrypoint`, its WorkerPool)."""
    disco, api = disco_module()
    _register_pool()
    _started.clear()
    sess = disco.Session.__new__(disco.ProcessSession)
    sess.__init_handle_by_constructor__(api.SessionProcess, world, 1, POOL_FUNC, entrypoint)
    (pool,) = _started
    _started.clear()
    return sess, pool
