"""The driver of a tensor-parallel group: one Disco worker per rank (worker 0 a thread of this process), each
running its slice of the model; steps are broadcast, logits read from worker 0, failures turned into errors.

A worker that dies or stops answering never hangs the driver: the collectives time out or see the peer gone
(ccl.py), the step returns, and the driver raises ParallelError; the session is then disarmed (disco.py).
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Sequence

import numpy as np

from ..errors import ContextOverflowError, EllmError
from ..runtime.sampling import Sampler, SamplingConfig
from ..runtime.limits import context_size
from ..runtime.state import Emitter, GenerationStats, decode_until_stop
from . import ccl, worker
from .build import read_group

ENTRYPOINT = "ellm.parallel.worker"


_ABANDONED: list = []  # sessions of failed groups (close)


class ParallelError(EllmError):
    """A rank of a tensor-parallel group failed: its process died, it stopped answering, or its step raised."""


def rank_cpus(world: int, cpus: Sequence[int] | None = None) -> list[tuple[int, ...]]:
    """CPUs per rank: the process's CPUs split into `world` consecutive runs (a NUMA node each, where the
    machine has that many nodes; numa/topology.py orders CPUs by node)."""
    from ..numa.topology import allowed_cpus

    cpus = sorted(cpus if cpus is not None else allowed_cpus())
    if len(cpus) < world:
        raise EllmError(f"{world} ranks need at least {world} CPUs, this process may use {len(cpus)}")
    per, extra = divmod(len(cpus), world)
    out, start = [], 0
    for r in range(world):
        n = per + (r < extra)
        out.append(tuple(cpus[start : start + n]))
        start += n
    return out


class ParallelEngine:
    def __init__(self, path: str | Path, ctx_size: int | None = None, timeout_s: float = 60.0,
                 cpus: Sequence[int] | None = None, transport: str = "shm"):
        """`timeout_s`: how long a rank waits for the others in a collective before the step fails.
        `transport`: "shm" (shared memory) or "tcp" (loopback here; across machines the same code, ccl.py)."""
        from ..runtime.artifact import Artifact
        from .disco import start_session

        self.group = read_group(Path(path))
        self.group.verify()
        self.world = self.group.world
        self.config = self.group.config
        rank0 = Artifact.open(self.group.rank_dir(0))  # checks the CPU and the files before any worker starts
        self.tokenizer = rank0.tokenizer()
        self.ctx_size = context_size(ctx_size, self.config.ctx_train)
        self.max_chunk = int(rank0.manifest["max_chunk"])
        self.cpus = rank_cpus(self.world, cpus)
        self.tokens: list[int] = []
        self.stats = GenerationStats()
        self.decode_traffic = ccl.Traffic()  # what the last generate's decode steps moved (rank 0's view)
        self._broken: str | None = None
        # one slot holds the largest thing a rank publishes: a chunk's residual stream or its logits slice
        slot = 4 * self.max_chunk * max(self.config.d_model, max(tp.vocab_widths[tp.rank] for tp in self.group.ranks))
        if transport not in ("shm", "tcp"):
            raise EllmError(f"transport must be shm or tcp, got {transport!r}")
        self.transport = transport
        self._name = f"{os.getpid()}-{time.monotonic_ns()}"  # this group among the driver's (worker.state)
        segment = f"/dev/shm/ellm-tp-{self._name}"
        if transport == "shm":
            from .shm import create_segment

            create_segment(segment, self.world, slot)
            spec = f"shm:{segment}"
        else:
            from .tcp import free_local_addresses

            spec = f"tcp:{free_local_addresses(self.world)}"
        try:
            worker.register()
            self._sess, self._pool = start_session(self.world, ENTRYPOINT)
            self._fns = {n: self._sess.get_global_func(n) for n in (worker.OPEN, worker.STEP, worker.CLOSE)}
            self._call(worker.OPEN, str(self.group.path), spec, slot, float(timeout_s),
                       ";".join(",".join(map(str, c)) for c in self.cpus), int(self.ctx_size), sync_all=True)
        except ParallelError:
            self.close()
            raise
        finally:
            if transport == "shm":
                os.unlink(segment)  # every rank that opened it keeps its mapping

    # --- calls into the group ----------------------------------------------------------------
    @property
    def _rank0(self) -> worker.RankState:
        st = worker.state(self._name, 0)
        assert st is not None
        return st

    def _call(self, name: str, *args, sync_all: bool = False) -> None:
        if self._broken:
            raise ParallelError(f"the tensor-parallel group failed earlier ({self._broken}); load it again")
        dead = self._pool.dead()
        if dead:  # before Disco writes to its pipe: a broadcast broken half-way leaves a session that cannot close
            self._fail(f"rank {dead[0][0]} (pid {dead[0][1]}) died")
        try:
            self._sess.call_packed(self._fns[name], self._name, *args)
            for w in range(self.world if sync_all else 1):
                self._sess._sync_worker(w)
        except Exception as e:  # noqa: BLE001 (Disco reports a dead worker's pipe as a TVM error)
            self._fail(f"a worker's pipe broke ({' '.join(str(e).split())[:200]})")
        st = worker.state(self._name, 0)
        comm = st.comm if st is not None else None
        errors = comm.errors() if comm is not None else []
        if st is not None and st.error and not errors:
            errors = [st.error]
        if comm is not None and sync_all:
            errors += [f"rank {r} did not start (its stderr says why)" for r in comm.absent()]
        if errors:
            self._fail("; ".join(errors))

    def _fail(self, why: str):
        self._broken = why
        self._pool.disarm()
        raise ParallelError(f"tensor-parallel group: {why}")

    def close(self) -> None:
        """Stop the workers (the group cannot run afterwards)."""
        if getattr(self, "_sess", None) is None:
            return
        try:
            if not self._broken:
                self._call(worker.CLOSE, sync_all=True)
        except ParallelError:
            pass
        finally:
            self._fns = {}
            if self._broken and "pipe broke" in self._broken:
                # a session whose broadcast broke half-way cannot shut down (TVM terminates the process in its
                # destructor): keep it, disarmed, for the life of the process
                _ABANDONED.append(self._sess)
            else:
                self._sess.shutdown()
                # registers still referenced (by callers, or cycles the collector frees later) are freed by
                # broadcasting to the workers: once these have exited, into /dev/null
                self._pool.disarm(grace_s=10.0)
            self._sess = None
            st = worker.state(self._name, 0)
            if st is not None and st.comm is not None:
                st.comm.close()
                st.comm = None

    def traffic(self) -> ccl.Traffic:
        """What rank 0's collectives moved so far (a copy)."""
        return replace(self._rank0.comm.traffic)

    # --- steps ----------------------------------------------------------------------------------
    @property
    def n_cached(self) -> int:
        return len(self.tokens)

    def _check(self, ids: Sequence[int]) -> list[int]:
        ids = [int(i) for i in ids]
        if any(not 0 <= i < self.config.vocab_size for i in ids):
            raise EllmError(f"token id out of range [0, {self.config.vocab_size})")
        if self.n_cached + len(ids) > self.ctx_size:
            raise ContextOverflowError(f"{self.n_cached + len(ids)} tokens do not fit in the context of "
                                       f"{self.ctx_size} tokens (use --ctx-size to enlarge it)")
        return ids

    def prefill(self, ids: Sequence[int]) -> np.ndarray:
        """Append `ids`; logits of the last [vocab] (a copy)."""
        from tvm_ffi import Shape

        ids = self._check(ids)
        if not ids:
            raise EllmError("prefill needs at least one token")
        for start in range(0, len(ids), self.max_chunk):
            chunk = ids[start : start + self.max_chunk]
            self._call(worker.STEP, "prefill", Shape(chunk), 0)
            self.tokens += chunk
        return np.array(self._rank0.logits)

    def decode(self, token: int) -> np.ndarray:
        """Append one token; its logits [vocab] (a view, valid until the next step)."""
        from tvm_ffi import Shape

        (token,) = self._check([token])
        self._call(worker.STEP, "decode", Shape([token]), 0)
        self.tokens.append(token)
        return self._rank0.logits

    def truncate(self, n: int) -> None:
        from tvm_ffi import Shape

        if not 0 <= n <= self.n_cached:
            raise ValueError(f"cannot truncate a cache of {self.n_cached} tokens to {n}")
        self._call(worker.STEP, "truncate", Shape([]), n)
        del self.tokens[n:]

    def generate(self, ids: Sequence[int], max_new_tokens: int, sampling: SamplingConfig | None = None,
                 stop_at_eog: bool = True, on_token=None, on_logits=None) -> list[int]:
        """New tokens continuing `ids` from an empty cache (greedy by default). `on_token(tok)` sees each token
        (returning True stops there); `on_logits(tok, logits)` the logits it was chosen from."""
        t0 = time.perf_counter()
        if not ids:
            raise EllmError("generate needs a non-empty prompt")
        if max_new_tokens < 1:
            raise EllmError(f"max_new_tokens must be at least 1, got {max_new_tokens}")
        self.truncate(0)
        sampler = Sampler(sampling or SamplingConfig())
        stats = self.stats = GenerationStats(prompt_tokens=len(ids))
        emit = Emitter(stats, max_new_tokens, list(ids), self.tokenizer.is_eog if stop_at_eog else None, on_token,
                       on_logits)
        logits = self.prefill(ids)
        stats.prefill_s = time.perf_counter() - t0
        t_dec, before = time.perf_counter(), self.traffic()
        first = sampler.choose(logits, emit.history)
        if not emit(first, logits):
            decode_until_stop(self, first, sampler, emit)
        stats.decode_s = time.perf_counter() - t_dec if stats.decode_tokens else 0.0
        self.decode_traffic = self.traffic().since(before)
        return emit.out
