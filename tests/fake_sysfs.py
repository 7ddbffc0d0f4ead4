"""Fake /sys trees of any NUMA shape (ELLM_SYSFS_ROOT points the topology reader at one)."""

from __future__ import annotations

from pathlib import Path


def _cpu_list(cpus) -> str:
    return ",".join(str(c) for c in sorted(cpus))


def make_sysfs(root: Path, cores_per_node: list[int], smt: int = 1, memory_gib: list[float] | None = None,
               distances: list[list[int]] | None = None) -> Path:
    """Nodes with the given physical core counts; `smt` CPUs per core, numbered as x86 Linux does (core j's
    siblings are CPUs j, j + cores, j + 2 * cores, ...). Distances default to 10 local, 21 remote."""
    n = len(cores_per_node)
    total = sum(cores_per_node)
    memory_gib = memory_gib or [16.0] * n
    distances = distances or [[10 if i == j else 21 for j in range(n)] for i in range(n)]
    first = 0
    for node, k in enumerate(cores_per_node):
        cores = range(first, first + k)
        cpus = [c + t * total for c in cores for t in range(smt)]
        d = root / "devices/system/node" / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(_cpu_list(cpus) + "\n")
        (d / "distance").write_text(" ".join(map(str, distances[node])) + "\n")
        kb = int(memory_gib[node] * 2**20)
        (d / "meminfo").write_text(f"Node {node} MemTotal:       {kb} kB\nNode {node} MemFree:        {kb // 2} kB\n")
        for c in cores:
            sibs = [c + t * total for t in range(smt)]
            for cpu in sibs:
                topo = root / "devices/system/cpu" / f"cpu{cpu}" / "topology"
                topo.mkdir(parents=True)
                (topo / "core_cpus_list").write_text(_cpu_list(sibs) + "\n")
                (topo / "thread_siblings_list").write_text(_cpu_list(sibs) + "\n")
        first += k
    (root / "devices/system/cpu/online").write_text(f"0-{total * smt - 1}\n")
    return root
