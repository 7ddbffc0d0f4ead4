"""Linux memory-policy calls (mbind, get_mempolicy, move_pages, mlock) through ctypes, without libnuma:
placement must work on any Linux with the syscalls and degrade to a no-op with a reason where it cannot.

Addresses are NumPy arrays' own: a range is the pages an array's bytes span. Node masks are bitmasks of node ids.
"""

from __future__ import annotations

import ctypes
import os
import platform
from dataclasses import dataclass

import numpy as np

PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
MAX_NODES = 1024  # bits in the masks handed to the kernel (its MAX_NUMNODES is at most this)

MPOL_DEFAULT, MPOL_PREFERRED, MPOL_BIND, MPOL_INTERLEAVE = 0, 1, 2, 3
MPOL_F_NODE, MPOL_F_ADDR = 1, 2
MPOL_MF_MOVE = 2
POLICY_NAMES = {MPOL_DEFAULT: "default", MPOL_PREFERRED: "preferred", MPOL_BIND: "bind", MPOL_INTERLEAVE: "interleave"}

# x86-64 and aarch64 syscall numbers
_SYSCALLS = {"x86_64": {"mbind": 237, "get_mempolicy": 239, "move_pages": 279},
             "aarch64": {"mbind": 235, "get_mempolicy": 236, "move_pages": 239}}


class PlacementUnavailable(OSError):
    """The kernel or the platform refused a memory-policy call; the caller falls back and says why."""


def _libc():
    if platform.system() != "Linux":
        raise PlacementUnavailable("memory policies need Linux")
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _call(name: str, *args) -> int:
    nums = _SYSCALLS.get(platform.machine())
    if nums is None:
        raise PlacementUnavailable(f"no {name} syscall number known for {platform.machine()}")
    r = _libc().syscall(ctypes.c_long(nums[name]), *args)
    if r < 0:
        err = ctypes.get_errno()
        raise PlacementUnavailable(err, f"{name}: {os.strerror(err)}")
    return r


def _mask(nodes) -> ctypes.Array:
    words = (ctypes.c_ulong * (MAX_NODES // 64))()
    for n in nodes:
        if not 0 <= n < MAX_NODES:
            raise ValueError(f"NUMA node {n} out of range")
        words[n // 64] |= 1 << (n % 64)
    return words


def _nodes_of(mask: ctypes.Array) -> tuple[int, ...]:
    return tuple(i * 64 + b for i, w in enumerate(mask) for b in range(64) if w >> b & 1)


def page_span(a: np.ndarray, start: int = 0, stop: int | None = None) -> tuple[int, int]:
    """(address, length) of the whole pages holding bytes [start, stop) of `a` (contiguous)."""
    base = a.ctypes.data
    stop = a.nbytes if stop is None else stop
    lo = (base + start) // PAGE * PAGE
    hi = -(-(base + stop) // PAGE) * PAGE
    return lo, hi - lo


def inner_span(a: np.ndarray, start: int = 0, stop: int | None = None) -> tuple[int, int]:
    """(address, length) of the whole pages inside bytes [start, stop) of `a`: binding them leaves pages shared
    with a neighbouring range alone (those take the first toucher's node)."""
    base = a.ctypes.data
    stop = a.nbytes if stop is None else stop
    lo = -(-(base + start) // PAGE) * PAGE
    hi = (base + stop) // PAGE * PAGE
    return lo, max(0, hi - lo)


def bind(addr: int, length: int, nodes, policy: int = MPOL_BIND, move: bool = False) -> None:
    """mbind(2): pages of [addr, addr + length) are allocated on `nodes` (MPOL_BIND) or interleaved over them.
    Pages already present stay where they are unless `move`."""
    if length <= 0:
        return
    mask = _mask(nodes)
    _call("mbind", ctypes.c_void_p(addr), ctypes.c_ulong(length), ctypes.c_int(policy), mask,
          ctypes.c_ulong(MAX_NODES + 1), ctypes.c_uint(MPOL_MF_MOVE if move else 0))


@dataclass(frozen=True)
class Policy:
    mode: str  # default | preferred | bind | interleave
    nodes: tuple[int, ...]


def policy_at(addr: int) -> Policy:
    """get_mempolicy(MPOL_F_ADDR): the policy governing the page at `addr`."""
    mode, mask = ctypes.c_int(0), _mask(())
    _call("get_mempolicy", ctypes.byref(mode), mask, ctypes.c_ulong(MAX_NODES + 1), ctypes.c_void_p(addr),
          ctypes.c_ulong(MPOL_F_ADDR))
    return Policy(POLICY_NAMES.get(mode.value & 0xFF, str(mode.value)), _nodes_of(mask))


def page_nodes(addr: int, length: int, step: int = 1) -> np.ndarray:
    """move_pages(2) with no target nodes: the node of each present page of the range (every `step`-th page),
    or a negative errno (-ENOENT: not yet touched)."""
    n_pages = -(-length // PAGE)
    addrs = np.arange(addr // PAGE * PAGE, addr + length, PAGE * step, dtype=np.uint64)[: -(-n_pages // step)]
    status = np.zeros(len(addrs), np.int32)
    chunk = 1 << 16
    for i in range(0, len(addrs), chunk):
        a, s = addrs[i : i + chunk], status[i : i + chunk]
        _call("move_pages", 0, ctypes.c_ulong(len(a)), ctypes.c_void_p(a.ctypes.data), None,
              ctypes.c_void_p(s.ctypes.data), 0)
    return status


def lock(addr: int, length: int) -> None:
    """mlock(2): keep the range resident (no page faults, no swap-out)."""
    libc = _libc()
    if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(length)) != 0:
        err = ctypes.get_errno()
        raise PlacementUnavailable(err, f"mlock: {os.strerror(err)}")


def memlock_limit() -> int | None:
    """RLIMIT_MEMLOCK's soft limit in bytes (None: unlimited)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft
