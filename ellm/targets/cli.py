"""`ellm targets`: the detected CPU, its NUMA topology, and the target presets (which of them run here)."""

from __future__ import annotations

import argparse
import json


def add_parser(sub) -> None:
    t = sub.add_parser("targets", help="show the detected CPU, its NUMA topology and the target presets")
    t.add_argument("--json", action="store_true", help="one JSON object: host, numa, presets")
    t.set_defaults(func=cmd_targets)


def cmd_targets(a: argparse.Namespace) -> int:
    from ..numa.topology import default_threads, read_topology
    from . import MASK_ENV, PRESETS, cpu_mask, detect_host, preset_for_host

    host = detect_host()
    topo = read_topology()
    if a.json:
        print(json.dumps({
            "host": host.record(), "default_threads": default_threads(topo), "numa": topo.to_dict(),
            "presets": [{"name": p.name, "isa": p.isa.label if p.isa is not None else None, "runs": host.can_run(p)}
                        for p in PRESETS.values()],
        }))
        return 0
    print(f"host: {host.model_name} (LLVM cpu {host.llvm_cpu}), {host.logical_cpus} logical CPUs, caches {host.caches}")
    for line in topo.describe():
        print(line)
    print(f"default threads: {default_threads(topo)} (physical cores this process may use)")
    if cpu_mask():
        print(f"{MASK_ENV}: treating the host as lacking {', '.join(cpu_mask())}")
    print(f"auto -> {preset_for_host(host).name}")
    for p in PRESETS.values():
        runs = "runs here" if host.can_run(p) else "cannot run here"
        isa = p.isa.label if p.isa is not None else "float only"
        print(f"  {p.name:16s} {isa:13s} {runs:15s} {p.description}")
    return 0
