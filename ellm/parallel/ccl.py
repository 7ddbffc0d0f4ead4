"""eLLM's CPU collective for tensor-parallel ranks: all-reduce and all-gather over a transport (shared memory
within a machine, shm.py; TCP across machines, tcp.py), registered as the packed functions a rank's VM calls
and as Disco's own collective builtins.

TVM 0.27's Disco ships collectives for NCCL and RCCL only. This one never raises into the caller: a rank that
fails (a dead or silent peer, a bad buffer) records why, returns at once from this and every later collective,
and the driver reads the failure after the step (engine.py). An exception escaping a function that Disco runs
on worker 0 (a thread of the driver) would abort the driver instead.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

@dataclass
class Traffic:
    """What one rank's collectives moved: calls, bytes it published, bytes it read from the other ranks."""

    calls: int = 0
    bytes_out: int = 0
    bytes_in: int = 0
    wait_s: float = 0.0  # spent waiting for the other ranks

    def since(self, before: Traffic) -> Traffic:
        return Traffic(self.calls - before.calls, self.bytes_out - before.bytes_out, self.bytes_in - before.bytes_in,
                       self.wait_s - before.wait_s)

    def per(self, steps: int) -> dict[str, float]:
        """Per step (token): collectives, bytes published, bytes read from the other ranks, seconds waiting."""
        n = max(1, steps)
        return {"collectives": self.calls / n, "bytes_out": self.bytes_out / n, "bytes_in": self.bytes_in / n,
                "wait_s": self.wait_s / n}


class Communicator:
    """One rank's end of a group: the collectives, over a transport's exchange of every rank's bytes."""

    rank: int
    world: int
    timeout_s: float
    traffic: Traffic

    def _exchange(self, data: np.ndarray) -> list[np.ndarray]:
        """Send this rank's bytes `data` [n] uint8, and receive every rank's (this one's included), in rank
        order, valid until the next exchange."""
        raise NotImplementedError

    @property
    def failed(self) -> bool:
        raise NotImplementedError

    def fail(self, why: str) -> None:
        """Record this rank's failure (the first reason is kept); the other ranks stop waiting for it."""
        raise NotImplementedError

    def errors(self) -> list[str]:
        """The failures this rank knows of, in rank order."""
        raise NotImplementedError

    def absent(self) -> list[int]:
        """Ranks that never joined the group."""
        return []

    def close(self) -> None:
        pass

    def _count(self, nbytes: int, parts: list[np.ndarray]) -> None:
        self.traffic.calls += 1
        self.traffic.bytes_out += nbytes
        self.traffic.bytes_in += sum(p.size for r, p in enumerate(parts) if r != self.rank)

    def allreduce(self, send: np.ndarray, out: np.ndarray) -> None:
        """out = the sum over ranks of `send`, added in rank order on every rank (so every rank's copy of the
        replicated residual stream stays bit-identical)."""
        raw = self._exchange(np.ascontiguousarray(send).reshape(-1).view(np.uint8))
        parts = [p.view(send.dtype).reshape(send.shape) for p in raw]
        np.add(parts[0], parts[1], out=out)
        for p in parts[2:]:
            np.add(out, p, out=out)

    def allgather(self, send: np.ndarray, widths: tuple[int, ...], out: np.ndarray) -> None:
        """out[..., rank r's columns] = rank r's `send` [..., widths[r]], concatenated in rank order."""
        raw = self._exchange(np.ascontiguousarray(send).reshape(-1).view(np.uint8))
        lead = send.shape[:-1]
        start = 0
        for p, w in zip(raw, widths):
            out[..., start : start + w] = p.view(send.dtype).reshape(*lead, w)
            start += w


# how long the ranks of a TCP group wait for each other to connect: apart from a collective's timeout, since
# they are processes still starting (importing TVM, opening their artifacts), seconds apart on a loaded machine
ASSEMBLE_S = 60.0


def connect(spec: str, rank: int, world: int, slot_bytes: int, timeout_s: float) -> Communicator:
    """Rank `rank`'s end of the group `spec`: "shm:PATH" (a segment from create_segment, one machine) or
    "tcp:HOST:PORT,..." (one address per rank, machines anywhere)."""
    kind, _, where = spec.partition(":")
    if kind == "shm":
        from .shm import ShmCommunicator

        return ShmCommunicator(where, rank, world, slot_bytes, timeout_s)
    if kind == "tcp":
        from .tcp import TcpCommunicator, parse_addresses

        addresses = parse_addresses(where)
        if len(addresses) != world:
            raise ValueError(f"{len(addresses)} addresses for {world} ranks")
        return TcpCommunicator(addresses, rank, timeout_s, assemble_s=max(timeout_s, ASSEMBLE_S))
    raise ValueError(f"unknown transport {kind!r} (shm or tcp)")


# --- the packed functions a rank's VM calls --------------------------------------------------------
# The group of each Disco worker thread (worker 0 of every group a driver runs lives in the driver's process),
# keyed by the OS thread: the packed functions have no other way to receive it, and threading.local does not
# survive between calls from a thread Python did not start (each call gets a fresh Python thread state).
_comms: dict[int, Communicator] = {}


def attach(comm: Communicator | None) -> None:
    """Make `comm` the calling thread's group (None: leave it)."""
    tid = threading.get_native_id()
    if comm is None:
        _comms.pop(tid, None)
    else:
        _comms[tid] = comm


def current() -> Communicator | None:
    return _comms.get(threading.get_native_id())


def _run(op, *args) -> None:
    comm = current()
    if comm is None:
        # only reachable outside a group: a rank's artifact run on its own, in the caller's thread
        raise RuntimeError("a tensor-parallel rank's kernels run inside its group (ellm.parallel.ParallelEngine)")
    if comm.failed:
        return  # the step runs to its end on garbage; the driver reports the failure
    try:
        op(comm, *args)
    except Exception as e:  # noqa: BLE001 (nothing may escape into Disco's worker 0)
        comm.fail(str(e))


def _allreduce(send, recv) -> None:
    _run(lambda c: c.allreduce(np.from_dlpack(send), np.from_dlpack(recv)))


def _allgather(send, widths, recv) -> None:
    _run(lambda c: c.allgather(np.from_dlpack(send), tuple(int(w) for w in widths), np.from_dlpack(recv)))


# Disco's own collective builtins (Session.allreduce / allgather), whose NCCL versions this process cannot have:
# the same group. reduce_kind: 0 sum (the only one the ranks need); allgather concatenates along the first axis.
def _disco_allreduce(send, reduce_kind, in_group, recv) -> None:
    if int(reduce_kind[0]) != 0:
        _run(lambda c: c.fail(f"only the sum all-reduce is implemented, not kind {int(reduce_kind[0])}"))
        return
    _allreduce(send, recv)


def _disco_allgather(send, in_group, recv) -> None:
    def gather(c: Communicator) -> None:
        x, out = np.from_dlpack(send), np.from_dlpack(recv)
        parts = c._exchange(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
        out.reshape(c.world, *x.shape)[...] = [p.view(x.dtype).reshape(x.shape) for p in parts]

    _run(gather)


def register() -> None:
    """Register the collectives the compiled ranks call (compiler/lower.py names them) and Disco's builtins;
    before a VM loads (the VM resolves its packed functions once)."""
    import tvm_ffi

    from ..compiler.lower import CCL_ALLGATHER, CCL_ALLREDUCE

    tvm_ffi.register_global_func(CCL_ALLREDUCE, _allreduce, override=True)
    tvm_ffi.register_global_func(CCL_ALLGATHER, _allgather, override=True)
    tvm_ffi.register_global_func("runtime.disco.allreduce", _disco_allreduce, override=True)
    tvm_ffi.register_global_func("runtime.disco.allgather", _disco_allgather, override=True)
