"""Measurement on the CPUs registered with TVM's RPC tracker (`python -m tvm.exec.rpc_tracker`, servers
`python -m tvm.exec.rpc_server --tracker HOST:PORT --key KEY`): candidates are built here and measured on
every server of the key at once, one open session per server.

Each trial uploads the candidate's library, runs it once from the kernel's initial inputs (the same random
inputs as local runs) and compares what it wrote with the default's outputs on the remote CPU (the
differential check of runner.py), then times it with TVM's `time_evaluator`. One-token kernels are timed as
a decode step sees them: the evaluator writes what the rest of the step reads between two calls
(`cache_flush_bytes`: measure.reuse_bytes, the step's bytes or at most COLD_CACHES times this host's
last-level cache, less the call's own) before each single call, where local runs stream copies of the
weights instead; chunks are timed hot. A
server that dies mid-run takes only its in-flight trial with it (recorded as run_error); the others go on.
"""

from __future__ import annotations

import os
import queue
import statistics
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from ..errors import EllmError
from .builder import Built
from .measure import Workload
from .runner import KernelBench, Trial, kernel_key, mismatch

COLD_REPEATS = 30  # single cold calls per timing (each after a cache flush)


def parse_tracker(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise EllmError(f"--rpc-tracker wants HOST:PORT, got {text!r}")
    return host, int(port)


class _Session:
    def __init__(self, remote, where: str):
        self.remote, self.where, self.dev = remote, where, remote.cpu()
        self._scratch: tuple[str, list] | None = None  # (kernel, its arguments on the server)

    def arguments(self, kernel: str, initial: list) -> list:
        """The kernel's initial inputs in one set of server tensors, refilled for each candidate (a module
        loaded on the server keeps its first call's arguments alive: fresh ones would pile up there)."""
        import tvm

        if self._scratch is None or self._scratch[0] != kernel:
            self._scratch = (kernel, [tvm.runtime.tensor(a, self.dev) if isinstance(a, np.ndarray) else a for a in initial])
        else:
            for t, a in zip(self._scratch[1], initial):
                if isinstance(a, np.ndarray):
                    t.copyfrom(a)
        return self._scratch[1]

    def cpu(self) -> tuple[str, list[str]]:
        """The server's CPU as LLVM names its core, and that core's compute features (LLVM's definition of it:
        a feature map does not cross RPC)."""
        import tvm
        from tvm.target import codegen

        from ..targets.features import compute_features

        name = str(self.remote.get_function("tvm.codegen.llvm.GetHostCPUName")())
        feats = codegen.llvm_get_cpu_features(tvm.target.Target({"kind": "llvm", "mcpu": name}))
        return name, compute_features(sorted(str(f) for f in feats))


class RPCRunner:
    """Runs trials on `sessions` servers of `key` (default: as many as the tracker has free for it)."""

    name = "rpc"

    def __init__(self, tracker: str, key: str, workload: Workload = Workload(), sessions: int | None = None,
                 session_timeout: int = 0, cpu_label: str | None = None, threads: int | None = None):
        """`cpu_label`: the servers' CPU model as records name it (default: the key and LLVM's name for the
        core); name it as `HostCPU.identity` does on those machines so compile there finds the records."""
        import tvm.rpc

        self.host, self.port = parse_tracker(tracker)
        self.key, self.workload, self.timeout, self.threads = key, workload, session_timeout, threads
        self.name = f"rpc:{key}"
        try:
            self._tracker = tvm.rpc.connect_tracker(self.host, self.port)
            summary = self._tracker.summary()
        except (OSError, RuntimeError) as e:
            raise EllmError(f"cannot reach the RPC tracker at {tracker}: {e}") from None
        servers = sum(1 for srv in summary.get("server_info", []) if srv.get("key") == f"server:{key}")
        self.sessions = sessions or servers
        if self.sessions < 1:
            raise EllmError(f"the RPC tracker at {tracker} has no server with key {key!r}")
        self._lock = threading.Lock()  # session counts, benches, references
        self._tracker_lock = threading.Lock()  # the tracker connection: one request at a time
        self._idle: queue.Queue[_Session] = queue.Queue()
        self._open = 0
        self._benches: dict[str, KernelBench] = {}
        self._reference: dict[str, list[np.ndarray]] = {}
        self._pool = ThreadPoolExecutor(self.sessions)
        first = self._acquire()  # what the servers are: records name the CPU measured on, not this host's
        llvm_cpu, self.cpu_features = first.cpu()
        self.cpu = cpu_label or f"{key} [{llvm_cpu}]"
        self._idle.put(first)

    # --- sessions -----------------------------------------------------------------------
    def _request(self) -> _Session:
        """A session on a free server, and which server it is (the tracker's address for it)."""
        import tvm.rpc
        from tvm.rpc import base

        with self._tracker_lock:  # not self._lock: the tracker answers only once a server is free
            trk = self._tracker
            base.sendjson(trk._sock, [base.TrackerCode.REQUEST, self.key, "", 1])
            value = base.recvjson(trk._sock)
        if value[0] != base.TrackerCode.SUCCESS:
            raise RuntimeError(f"the tracker refused a session for {self.key}: {value}")
        url, port, match = value[1]
        sess = _Session(tvm.rpc.connect(url, port, match, self.timeout), f"rpc:{self.key}@{url}:{port}")
        if self.threads:  # TVM's pool starts with one thread
            sess.remote.get_function("runtime.config_threadpool")(1, self.threads)
        return sess

    def _acquire(self) -> _Session:
        """An idle session, or a new one while fewer are open than servers remain; waits for one otherwise."""
        wait = 0.0  # a server not yet in use is taken at once, not after an idle one was waited for
        while True:
            try:
                return self._idle.get(timeout=wait) if wait else self._idle.get_nowait()
            except queue.Empty:
                pass
            with self._lock:
                if self.sessions < 1:
                    raise RuntimeError(f"every RPC server of key {self.key!r} was lost")
                grow = self._open < self.sessions
                if grow:
                    self._open += 1
            if grow:
                try:
                    return self._request()
                except Exception:
                    self._drop()
                    raise
            wait = 0.2

    def _drop(self) -> None:
        """A session is gone (its server died or hung up): one server fewer to wait for."""
        with self._lock:
            self._open -= 1
            self.sessions -= 1

    def _failed(self, sess: _Session, e: Exception) -> Trial:
        """The trial failed: if its server still answers, the candidate did (its session goes back), else
        the server is lost and so is only this trial."""
        try:
            sess.remote.get_function("tvm.rpc.server.workpath")("probe")
            alive = True
        except Exception:  # noqa: BLE001
            alive = False
        if alive:
            self._idle.put(sess)
            return Trial("run_error", message=f"{sess.where}: {type(e).__name__}: {e}", runner=sess.where)
        self._drop()
        return Trial("run_error", message=f"{sess.where} lost: {type(e).__name__}: {e}", runner=sess.where)

    # --- trials -------------------------------------------------------------------------
    def _bench(self, built: Built) -> KernelBench:
        j = built.job
        key = kernel_key(j)
        with self._lock:
            if key not in self._benches:
                self._benches = {key: KernelBench(j.rule, j.req, j.target, self.workload)}
            return self._benches[key]

    def run(self, built: Built, is_default: bool = False) -> Trial:
        return self.run_many([built], [is_default])[0]

    def run_many(self, builts: Sequence[Built], defaults: Sequence[bool]) -> list[Trial]:
        """The defaults first (their outputs are the reference), then the rest on all sessions at once."""
        out: list[Trial | None] = [None] * len(builts)
        for i, (b, d) in enumerate(zip(builts, defaults)):
            if d:
                out[i] = self._one(b, True)
        rest = [i for i, d in enumerate(defaults) if not d]
        for i, t in zip(rest, self._pool.map(lambda i: self._one(builts[i], False), rest)):
            out[i] = t
        return out  # type: ignore[return-value]

    def _one(self, built: Built, is_default: bool) -> Trial:
        import tvm

        if built.status != "ok":
            return Trial(built.status, message=built.message)
        bench = self._bench(built)
        try:
            sess = self._acquire()
        except Exception as e:  # noqa: BLE001
            return Trial("run_error", message=f"no RPC session for {self.key}: {e}")
        try:
            sess.remote.upload(built.path)
            mod = sess.remote.load_module(os.path.basename(built.path))
            args = sess.arguments(kernel_key(built.job), bench.initial)
            mod["kernel"](*args)
            outs = [t.numpy() for t in args if isinstance(t, tvm.runtime.Tensor)]
        except Exception as e:  # noqa: BLE001 - a lost server or a crash of the candidate
            return self._failed(sess, e)
        kernel = built.job.req.key()
        with self._lock:
            ref = self._reference.get(kernel)
            if is_default or ref is None:
                self._reference[kernel] = outs
                ref = None
        if ref is not None:
            bad = mismatch(outs, ref)
            if bad:
                self._idle.put(sess)
                return Trial("wrong", message=f"differs from the default: {bad}", runner=sess.where)
        try:
            cold = bench.cold
            ev = mod.time_evaluator("kernel", sess.dev, number=1 if cold else 3, repeat=COLD_REPEATS if cold else 3,
                                    cache_flush_bytes=self._flush_bytes(bench) if cold else 0)
            t = list(ev(*args).results)
        except Exception as e:  # noqa: BLE001
            return self._failed(sess, e)
        self._idle.put(sess)
        stats = {"median": statistics.median(t), "min": min(t), "max": max(t), "passes": len(t), "calls": 1 if cold else 3,
                 "bytes": bench.bytes, "method": "rpc-flush" if cold else "rpc-hot"}
        return Trial("ok", stats["median"], stats, runner=sess.where)

    def _flush_bytes(self, bench: KernelBench) -> int:
        """Bytes written before a cold call: what the rest of a decode step reads between two of its calls
        (measure.reuse_bytes, less the call's own bytes, which the call itself reads)."""
        return max(bench.reuse - bench.bytes, 0)

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        while not self._idle.empty():
            self._idle.get_nowait()


__all__ = ["RPCRunner", "parse_tracker"]
