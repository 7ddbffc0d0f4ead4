"""The NUMA and memory options `ellm run`, `ellm serve` and the benchmarks share."""

from __future__ import annotations

import argparse

from .placement import NumaOptions
from .threadmap import NUMA_MODES


def add_numa_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--numa", choices=NUMA_MODES, default=None,
                   help="distribute: threads and memory over every NUMA node; isolate: only the node the process "
                        "starts on; numactl: the CPUs and memory policy numactl gave; none: no placement "
                        "(default: distribute on a machine of several nodes, none on one)")
    p.add_argument("--numa-pseudo-nodes", type=int, default=0, metavar="N",
                   help="split the cores into N simulated nodes (memory stays on the real ones): the partitioned "
                        "layout's cost where there is no NUMA")
    p.add_argument("--mlock", action="store_true", help="lock weights and KV cache in memory (no page faults, no swap)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--mmap", dest="mmap", action="store_true",
                   help="weights stay a memory map of the artifact: shared page cache, fast load, not placed on nodes")
    g.add_argument("--no-mmap", dest="mmap", action="store_false",
                   help="weights read into private, node-local memory on huge pages (the default)")
    p.set_defaults(mmap=False)


def numa_option(a: argparse.Namespace) -> NumaOptions:
    return NumaOptions(mode=a.numa, mlock=a.mlock, mmap=a.mmap, pseudo_nodes=a.numa_pseudo_nodes)
