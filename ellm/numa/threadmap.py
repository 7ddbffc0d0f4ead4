"""Which CPU runs each task of a parallel kernel, per `--numa` mode: task i of every kernel runs on CPU
`cpus[i]` (task 0 on the calling thread), and the tasks of one node are consecutive, so the contiguous row
ranges TVM's static partition gives consecutive tasks fall to one node's threads.

Modes, as llama.cpp names them:
- distribute: every node with CPUs this process may use, threads spread over them by their physical cores;
- isolate: only the node of the CPU the process started on;
- numactl: exactly the CPUs of the process's affinity mask (what `numactl --physcpubind/--cpunodebind` set),
  memory left to the policy numactl gave the process;
- none: TVM's own pinning, no memory placement (the behaviour before NUMA support).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import EllmError
from .topology import Topology

NUMA_MODES = ("distribute", "isolate", "numactl", "none")


@dataclass(frozen=True)
class ThreadMap:
    mode: str
    cpus: tuple[int, ...]  # [task] -> CPU
    nodes: tuple[int, ...]  # [task] -> NUMA node of that CPU

    def node_ids(self) -> tuple[int, ...]:
        """The nodes in use, in task order."""
        return tuple(dict.fromkeys(self.nodes))

    def cpus_of(self, node: int) -> tuple[int, ...]:
        return tuple(c for c, n in zip(self.cpus, self.nodes) if n == node)

    def to_dict(self) -> dict:
        return {"mode": self.mode, "cpus": list(self.cpus), "nodes": list(self.nodes)}


def current_cpu() -> int:
    """The CPU this thread runs on now (Linux: os.sched_getcpu where Python has it, else /proc)."""
    getcpu = getattr(os, "sched_getcpu", None)
    if getcpu is not None:
        return getcpu()
    fields = open("/proc/thread-self/stat").read().rsplit(")", 1)[1].split()
    return int(fields[36])  # field 39, "processor", counted after the command name


def _ordered(topology: Topology, allowed: set[int], node: int) -> list[int]:
    """A node's allowed CPUs, one per physical core first, then their SMT siblings."""
    cores = topology.physical_cores(allowed, {node})
    rest = [c for c in sorted(topology.node(node).cpus) if c in allowed and c not in cores]
    return cores + rest


def _shares(threads: int, capacity: list[int]) -> list[int]:
    """`threads` split over nodes in proportion to their physical cores (largest remainders first)."""
    total = sum(capacity)
    exact = [threads * c / total for c in capacity]
    counts = [int(x) for x in exact]
    for k in sorted(range(len(capacity)), key=lambda k: (counts[k] - exact[k], k))[: threads - sum(counts)]:
        counts[k] += 1
    return counts


def thread_map(mode: str, threads: int, topology: Topology, allowed: set[int],
               start_cpu: int | None = None) -> ThreadMap | None:
    """The task -> CPU map of `mode` for `threads` threads (None for mode none)."""
    if mode not in NUMA_MODES:
        raise EllmError(f"--numa must be one of {', '.join(NUMA_MODES)}, got {mode!r}")
    if mode == "none":
        return None
    if threads > len(allowed):
        raise EllmError(f"--numa {mode}: {threads} threads, but this process may use {len(allowed)} CPUs "
                        f"({sorted(allowed)})")
    if mode == "isolate":
        here = start_cpu if start_cpu is not None else current_cpu()
        use = [topology.node_of_cpu(here)]
    else:
        use = [n.id for n in topology.nodes if any(c in allowed for c in n.cpus)]
    pools = {n: _ordered(topology, allowed, n) for n in use}
    if mode == "numactl":
        counts = _shares(threads, [len(pools[n]) for n in use])
    else:
        counts = _shares(threads, [len(topology.physical_cores(allowed, {n})) or len(pools[n]) for n in use])
    cpus, nodes = [], []
    for n, k in zip(use, counts):
        if k > len(pools[n]):
            raise EllmError(f"--numa {mode}: node {n} has {len(pools[n])} CPUs this process may use, "
                            f"{k} threads asked of it")
        cpus += pools[n][:k]
        nodes += [n] * k
    return ThreadMap(mode, tuple(cpus), tuple(nodes))
