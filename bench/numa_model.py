"""The NUMA and across-machines model (ellm/numa/model.py) for SmolLM2-135M, Llama-3.2-1B and Llama-3.1-8B:
predicted decode tokens/s on a 2-socket server per placement, and with the model split over machines per
link. Every machine and link parameter is stated here and in the JSON; nothing is measured. Emits JSON and,
with --markdown, the tables docs/numa.md shows.

    python bench/numa_model.py [--local-gbs 360] [--distance 32] [--ctx 4096] [--markdown] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys

from gguf import GGMLQuantizationType as G

from ellm.bench.report import emit_report
from ellm.numa.model import Link, Machine, Workload, tokens_per_s_across, tokens_per_s_one_machine
from ellm.synth.shapes import SHAPES, ModelShape
from ellm.synth.type_mix import TYPE_MIXES, TypeMix

SMOLLM2 = ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tied=True)
WORKLOADS = (Workload.of(SMOLLM2, TypeMix("q4_1", G.Q4_1, G.Q8_0)),  # the bundled GGUF: Q4_1, Q8_0 embedding
             Workload.of(SHAPES["llama-1b"], TYPE_MIXES["q4_k_m"]),
             Workload.of(SHAPES["llama-8b"], TYPE_MIXES["q4_k_m"]))
LINKS = (Link("shared memory, one machine", 20.0, 1.0), Link("100 GbE, RDMA", 12.5, 3.0),
         Link("25 GbE, TCP", 3.1, 30.0), Link("10 GbE, TCP", 1.25, 50.0))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local-gbs", type=float, default=360.0,
                   help="bandwidth one socket's cores draw from its memory, GB/s (default: a 12-channel DDR5-4800 "
                        "EPYC 9004 socket's STREAM-class figure)")
    p.add_argument("--distance", type=int, default=32, help="SLIT distance to the other socket (10 = local)")
    p.add_argument("--barrier-us", type=float, default=1.0, help="a barrier across both sockets' threads, µs")
    p.add_argument("--ctx", type=int, default=4096)
    p.add_argument("--markdown", action="store_true")
    p.add_argument("--out")
    a = p.parse_args()
    server = Machine.from_distances(2, a.local_gbs, a.distance, a.barrier_us)
    one = {w.name: tokens_per_s_one_machine(w, server, a.ctx) for w in WORKLOADS}
    across = {w.name: {link.name: {m: tokens_per_s_across(w, a.local_gbs, m, link, a.ctx) for m in (1, 2, 4)}
                       for link in LINKS} for w in WORKLOADS}
    report = {"assumptions": {"machine": server.__dict__, "ctx": a.ctx, "links": [ln.__dict__ for ln in LINKS],
                              "per_machine_gbs": a.local_gbs, "kv": "float16"},
              "workloads": [w.__dict__ for w in WORKLOADS], "two_socket": one, "across_machines": across}
    if a.markdown:
        print(f"2 sockets, {a.local_gbs:.0f} GB/s local, {server.remote_gbs:.0f} GB/s remote, ctx {a.ctx}\n", file=sys.stderr)
        print("| model | MB/token | first touch | interleave | plan | plan / first touch |", file=sys.stderr)
        print("|---|---|---|---|---|---|", file=sys.stderr)
        for w in WORKLOADS:
            r = one[w.name]
            print(f"| {w.name} | {w.step_bytes(a.ctx) / 1e6:.0f} | {r['first_touch']:.0f} | {r['interleave']:.0f} | "
                  f"{r['plan']:.0f} | {r['plan'] / r['first_touch']:.2f}x |", file=sys.stderr)
        print("\n| model | link | 1 machine | 2 machines | 4 machines | KB sent/token (2) |", file=sys.stderr)
        print("|---|---|---|---|---|---|", file=sys.stderr)
        for w in WORKLOADS:
            for link in LINKS:
                r = across[w.name][link.name]
                print(f"| {w.name} | {link.name} ({link.gbs} GB/s, {link.latency_us} µs) | {r[1]['tokens_per_s']:.0f} | "
                      f"{r[2]['tokens_per_s']:.0f} | {r[4]['tokens_per_s']:.0f} | {r[2]['bytes_per_token'] / 1e3:.0f} |",
                      file=sys.stderr)
    return emit_report(report, a.out)


if __name__ == "__main__":
    sys.exit(main())
