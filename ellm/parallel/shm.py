"""The collective's transport within a machine: a shared-memory segment (on /dev/shm) every rank maps.

Segment layout: a header page of per-rank words [seq, pid, failed, bytes of generation 0 and 1] (64 bytes
apart) and error texts, then two generations of per-rank slots. Call k writes generation k % 2 of its own slot,
publishes seq = k, and spins until every rank's seq >= k: no rank can write a generation again before every
rank has read it. A rank that fails sets its word; the others see it, or see its process gone, or time out.
"""

from __future__ import annotations

import mmap
import os
import time

import numpy as np

from .ccl import Communicator, Traffic

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
