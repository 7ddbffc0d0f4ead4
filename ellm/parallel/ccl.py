"""eLLM's CPU collective for tensor-parallel ranks: all-reduce and all-gather over a transport (shared memory
within a machine, here; TCP across machines, tcp.py), registered as the packed functions a rank's VM calls.

TVM 0.27's Disco ships collectives for NCCL and RCCL only. This one never raises into the caller: a rank that
fails (a dead or silent peer, a bad buffer) records why in the segment, returns at once from this and every later
collective, and the driver reads the failure after the step (engine.py). An exception escaping a function that
Disco runs on worker 0 (a thread of the driver) would abort the driver instead.

The shared-memory transport (ShmCommunicator; tcp.py has the one across machines). Segment layout: a header
page of per-rank words [seq, pid, failed, bytes of generation 0 and 1] (64 bytes apart) and error texts, then
two generations of per-rank slots. Call k writes generation k % 2 of its own slot, publishes seq = k, and waits
for every rank's seq >= k: no rank can write a generation again before every rank has read it.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from dataclasses import dataclass

import numpy as np

HEADER = 64 * 1024
_WORDS = 8  # int64 words per rank in the header (one cache line)
_ERR_AT, _ERR_BYTES = 4096, 512
_CHECK_EVERY = 2048  # spins between checks of the clock and the peers


def segment_bytes(world: int, slot_bytes: int) -> int:
    return HEADER + 2 * world * slot_bytes


def create_segment(path: str, world: int, slot_bytes: int) -> None:
    """A zeroed segment file (on /dev/shm: memory, pages allocated as first written)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, segment_bytes(world, slot_bytes))
    finally:
        os.close(fd)


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, a child that exited and was not reaped yet, does not)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            state = f.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


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


class ShmCommunicator(Communicator):
    """One rank's end of the shared-memory group `path` (mapped whole; the driver unlinks the name once every
    rank has it)."""

    def __init__(self, path: str, rank: int, world: int, slot_bytes: int, timeout_s: float):
        self.rank, self.world, self.slot_bytes, self.timeout_s = rank, world, slot_bytes, timeout_s
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, segment_bytes(world, slot_bytes))
        finally:
            os.close(fd)
        buf = np.frombuffer(self._map, dtype=np.uint8)
        words = buf[: world * _WORDS * 8].view(np.int64).reshape(world, _WORDS)
        self._seq, self._pid, self._failed = words[:, 0], words[:, 1], words[:, 2]
        self._sizes = words[:, 3:5].T  # [generation, rank]: bytes in the slot
        self._err = buf[_ERR_AT : _ERR_AT + world * _ERR_BYTES].reshape(world, _ERR_BYTES)
        # [generation, rank, slot_bytes]
        self._slots = buf[HEADER:].reshape(2, world, slot_bytes)
        self._k = int(self._seq[rank])
        self._pid[rank] = os.getpid()
        self.traffic = Traffic()

    # --- failure -----------------------------------------------------------------------------
    @property
    def failed(self) -> bool:
        return bool(self._failed[self.rank])

    def fail(self, why: str) -> None:
        """Record this rank's failure (the first reason is kept) for the other ranks and the driver."""
        if not self._failed[self.rank]:
            data = f"rank {self.rank} (pid {os.getpid()}): {why}".encode()[: _ERR_BYTES - 1]
            self._err[self.rank, : len(data)] = np.frombuffer(data, np.uint8)
            self._failed[self.rank] = 1

    def errors(self) -> list[str]:
        """Every rank's recorded failure, in rank order."""
        return [bytes(self._err[r]).rstrip(b"\0").decode(errors="replace") for r in range(self.world)
                if self._failed[r]]

    def absent(self) -> list[int]:
        return [r for r in range(self.world) if not self._pid[r]]

    # --- the exchange ----------------------------------------------------------------------------
    def _exchange(self, data: np.ndarray) -> list[np.ndarray]:
        """Write `data` into this call's slot, announce it, wait for every rank's."""
        if data.size > self.slot_bytes:
            raise ValueError(f"{data.size} bytes exceed the group's {self.slot_bytes}-byte slots")
        self._k += 1
        slots = self._slots[self._k % 2]
        slots[self.rank, : data.size] = data
        self._sizes[self._k % 2, self.rank] = data.size
        self._seq[self.rank] = self._k
        self._wait(self._k)
        parts = [slots[r, : int(self._sizes[self._k % 2, r])] for r in range(self.world)]
        self._count(data.size, parts)
        return parts

    def _wait(self, k: int) -> None:
        seq, spins, t0 = self._seq, 0, time.perf_counter()
        while seq.min() < k:
            spins += 1
            if spins % _CHECK_EVERY:
                continue
            late = [r for r in range(self.world) if seq[r] < k]
            bad = [r for r in late if self._failed[r]]
            if bad:
                raise RuntimeError(f"rank {bad[0]} failed")
            dead = [r for r in late if self._pid[r] and not _alive(int(self._pid[r]))]
            if dead:
                raise RuntimeError(f"rank {dead[0]} (pid {int(self._pid[dead[0]])}) died")
            if time.perf_counter() - t0 > self.timeout_s:
                raise RuntimeError(f"rank {late[0]} did not answer within {self.timeout_s:g} s")
        self.traffic.wait_s += time.perf_counter() - t0

    def close(self) -> None:
        """Nothing to do: the mapping goes with the last view of it (numpy arrays the caller may still hold)."""


def connect(spec: str, rank: int, world: int, slot_bytes: int, timeout_s: float) -> Communicator:
    """Rank `rank`'s end of the group `spec`: "shm:PATH" (a segment from create_segment, one machine) or
    "tcp:HOST:PORT,..." (one address per rank, machines anywhere)."""
    kind, _, where = spec.partition(":")
    if kind == "shm":
        return ShmCommunicator(where, rank, world, slot_bytes, timeout_s)
    if kind == "tcp":
        from .tcp import TcpCommunicator, parse_addresses

        addresses = parse_addresses(where)
        if len(addresses) != world:
            raise ValueError(f"{len(addresses)} addresses for {world} ranks")
        return TcpCommunicator(addresses, rank, timeout_s)
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


def register() -> None:
    """Register the collectives the compiled ranks call (compiler/lower.py names them); before a VM loads."""
    import tvm_ffi

    from ..compiler.lower import CCL_ALLGATHER, CCL_ALLREDUCE

    tvm_ffi.register_global_func(CCL_ALLREDUCE, _allreduce, override=True)
    tvm_ffi.register_global_func(CCL_ALLGATHER, _allgather, override=True)
