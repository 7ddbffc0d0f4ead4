"""The machine's NUMA topology from sysfs: nodes, their CPUs, physical cores and memory, and the distance
matrix. `ELLM_SYSFS_ROOT=DIR` reads DIR as if it were /sys, so tests run against fake trees of any shape.

A machine without /sys/devices/system/node (a kernel built without NUMA) is one node holding every online
CPU and all of MemTotal.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import EllmError

SYSFS_ENV = "ELLM_SYSFS_ROOT"


def sysfs_root() -> Path:
    return Path(os.environ.get(SYSFS_ENV, "/sys"))


def parse_cpu_list(text: str) -> tuple[int, ...]:
    """'0-3,8,10-11' -> (0, 1, 2, 3, 8, 10, 11): the kernel's list format, sorted."""
    cpus: set[int] = set()
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        lo, _, hi = part.partition("-")
        try:
            a, b = int(lo), int(hi or lo)
        except ValueError:
            raise EllmError(f"not a CPU list: {text.strip()!r}") from None
        if b < a:
            raise EllmError(f"not a CPU list: {text.strip()!r}")
        cpus.update(range(a, b + 1))
    return tuple(sorted(cpus))


@dataclass(frozen=True)
class NumaNode:
    id: int
    cpus: tuple[int, ...]  # logical CPUs, SMT siblings included
    cores: tuple[tuple[int, ...], ...]  # the CPUs of each physical core (its SMT siblings), by lowest CPU
    memory_bytes: int

    @property
    def physical_cores(self) -> int:
        return len(self.cores)

    def to_dict(self) -> dict:
        return {"id": self.id, "cpus": list(self.cpus), "physical_cores": self.physical_cores,
                "cores": [list(c) for c in self.cores], "memory_bytes": self.memory_bytes}


@dataclass(frozen=True)
class Topology:
    nodes: tuple[NumaNode, ...]
    distances: tuple[tuple[int, ...], ...]  # [n_nodes, n_nodes], ACPI SLIT units: 10 = local

    def __post_init__(self):
        n = len(self.nodes)
        if n == 0:
            raise EllmError("a topology needs at least one NUMA node")
        if len(self.distances) != n or any(len(row) != n for row in self.distances):
            raise EllmError(f"the NUMA distance matrix must be {n} x {n}")

    @property
    def smt(self) -> bool:
        return any(len(c) > 1 for n in self.nodes for c in n.cores)

    def node(self, node_id: int) -> NumaNode:
        for n in self.nodes:
            if n.id == node_id:
                return n
        raise EllmError(f"no NUMA node {node_id} (nodes: {', '.join(str(n.id) for n in self.nodes)})")

    def node_of_cpu(self, cpu: int) -> int:
        for n in self.nodes:
            if cpu in n.cpus:
                return n.id
        raise EllmError(f"CPU {cpu} is on no NUMA node")

    def physical_cores(self, allowed: set[int] | None = None, nodes: set[int] | None = None) -> list[int]:
        """One CPU per physical core (the lowest allowed sibling), over the nodes in use (default: all): a
        core counts when any of its CPUs is allowed."""
        out = []
        for n in self.nodes:
            if nodes is not None and n.id not in nodes:
                continue
            for core in n.cores:
                mine = [c for c in core if allowed is None or c in allowed]
                if mine:
                    out.append(mine[0])
        return out

    def pseudo(self, parts: int) -> tuple[Topology, dict[int, int]]:
        """This machine's cores split into `parts` simulated nodes (contiguous groups of whole cores, in node
        order), and each pseudo-node's real memory node: to run the partitioned layout where there is no NUMA
        (its cost alone) or to rehearse a multi-node plan."""
        cores = [(n.id, core) for n in self.nodes for core in n.cores]
        if not 1 <= parts <= len(cores):
            raise EllmError(f"--numa-pseudo-nodes must be between 1 and the {len(cores)} physical cores, got {parts}")
        nodes, memory = [], {}
        for k in range(parts):
            mine = cores[len(cores) * k // parts : len(cores) * (k + 1) // parts]
            real = mine[0][0]
            nodes.append(NumaNode(k, tuple(sorted(c for _, core in mine for c in core)), tuple(core for _, core in mine),
                                  self.node(real).memory_bytes // parts))
            memory[k] = real
        distances = tuple(tuple(10 if i == j else 11 for j in range(parts)) for i in range(parts))
        return Topology(tuple(nodes), distances), memory

    def to_dict(self) -> dict:
        return {"nodes": [n.to_dict() for n in self.nodes], "distances": [list(r) for r in self.distances]}

    def describe(self) -> list[str]:
        lines = [f"NUMA: {len(self.nodes)} node{'s' if len(self.nodes) > 1 else ''}"
                 f"{', SMT' if self.smt else ''}"]
        for n, row in zip(self.nodes, self.distances):
            lines.append(f"  node {n.id}: {n.physical_cores} cores, {len(n.cpus)} CPUs "
                         f"({_ranges(n.cpus)}), {n.memory_bytes / 2**30:.1f} GiB, distances {list(row)}")
        return lines


def _ranges(cpus: tuple[int, ...]) -> str:
    parts, start = [], None
    for i, c in enumerate(cpus):
        if start is None:
            start = c
        if i + 1 == len(cpus) or cpus[i + 1] != c + 1:
            parts.append(str(start) if start == c else f"{start}-{c}")
            start = None
    return ",".join(parts)


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError as e:
        raise EllmError(f"cannot read {path}: {e.strerror}") from None


def _siblings(root: Path, cpu: int) -> tuple[int, ...]:
    topo = root / "devices/system/cpu" / f"cpu{cpu}" / "topology"
    for name in ("core_cpus_list", "thread_siblings_list"):
        if (topo / name).is_file():
            return parse_cpu_list(_read(topo / name))
    return (cpu,)


def _node_memory(node_dir: Path) -> int:
    m = re.search(r"MemTotal:\s+(\d+)\s*kB", _read(node_dir / "meminfo")) if (node_dir / "meminfo").is_file() else None
    return int(m.group(1)) * 1024 if m else 0


def _cores(root: Path, cpus: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """`cpus` grouped by physical core (siblings outside `cpus` left out), by lowest CPU."""
    mine = set(cpus)
    groups = {tuple(s for s in _siblings(root, c) if s in mine) or (c,) for c in cpus}
    return tuple(sorted(groups))


def read_topology(root: Path | None = None) -> Topology:
    """The topology under `root` (default: $ELLM_SYSFS_ROOT or /sys)."""
    root = sysfs_root() if root is None else Path(root)
    node_root = root / "devices/system/node"
    dirs = sorted((d for d in node_root.glob("node[0-9]*") if d.name[4:].isdigit()), key=lambda d: int(d.name[4:]))
    if not dirs:
        online = root / "devices/system/cpu/online"
        cpus = parse_cpu_list(_read(online)) if online.is_file() else tuple(range(os.cpu_count() or 1))
        mem = 0
        try:
            mem = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1)) * 1024
        except (OSError, AttributeError):
            pass
        return Topology((NumaNode(0, cpus, _cores(root, cpus), mem),), ((10,),))
    nodes, distances = [], []
    for d in dirs:
        cpus = parse_cpu_list(_read(d / "cpulist")) if (d / "cpulist").is_file() else ()
        nodes.append(NumaNode(int(d.name[4:]), cpus, _cores(root, cpus), _node_memory(d)))
        row = _read(d / "distance").split() if (d / "distance").is_file() else []
        distances.append(tuple(int(x) for x in row))
    if any(len(r) != len(nodes) for r in distances):  # missing or short distance files: local 10, remote 20
        distances = [tuple(10 if i == j else 20 for j in range(len(nodes))) for i in range(len(nodes))]
    return Topology(tuple(nodes), tuple(distances))


def _affinity() -> set[int]:
    try:
        return set(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return set(range(os.cpu_count() or 1))


# the process's CPUs as it started (taskset, numactl, cgroups), taken at import: pinning the calling thread
# (runtime/threads.py) narrows what sched_getaffinity reports afterwards
_START_CPUS = frozenset(_affinity())


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on, as it was started."""
    return set(_START_CPUS)


def default_threads(topology: Topology | None = None, allowed: set[int] | None = None) -> int:
    """The default thread count: the physical cores among the CPUs this process may run on (SMT siblings
    share a core's load ports and caches, so a second thread per core only contends for the same bytes)."""
    try:
        topo = topology or read_topology()
    except EllmError:
        return len(allowed or allowed_cpus())
    return max(1, len(topo.physical_cores(allowed if allowed is not None else allowed_cpus())))
