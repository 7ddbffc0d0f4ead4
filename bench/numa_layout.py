"""NUMA placement on this machine, each measurement in its own process (ellm.bench.worker), A and B
alternating: decode speed of the partitioned layout on pseudo-nodes against no placement, and load time and
resident memory of the weights read in (--no-mmap) against kept mapped (--mmap). Emits JSON.

    python bench/numa_layout.py ARTIFACT [--planned ARTIFACT2] [--pseudo-nodes 2] [--rounds 5] [--ctx 512]
                                [--gen 128] [--out FILE]

`--planned`: the partitioned side runs ARTIFACT2, compiled from the same model with `--numa-nodes N
--numa-threads T`, whose kernels run the plan's task -> thread map (ARTIFACT keeps TVM's static split).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

from ellm.bench.report import emit_report


def worker(artifact: str, a, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "ellm.bench.worker", "ellm", "--artifact", artifact, "--ctx", str(a.ctx),
           "--gen", str(a.gen), "--repeat", str(a.repeat), "--threads", str(a.threads), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(p.stdout)


def load(artifact: str, *extra: str) -> dict:
    """`ellm run` of one token in a fresh process: engine load seconds and peak resident memory."""
    cmd = [sys.executable, "-m", "ellm", "run", artifact, "-p", "Hello", "-n", "1", "--json", "--ctx-size", "512", *extra]
    t = time.perf_counter()
    out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    return {"load_s": out["load_s"], "max_rss_mib": out["max_rss_bytes"] / 2**20, "process_s": time.perf_counter() - t}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact")
    p.add_argument("--pseudo-nodes", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--control", action="store_true",
                   help="A/A: compare no placement with itself (this machine's noise floor for the ratio)")
    p.add_argument("--planned", metavar="ARTIFACT2",
                   help="run the partitioned side on this artifact (compiled with --numa-nodes and --numa-threads)")
    p.add_argument("--out")
    a = p.parse_args()
    artifacts = {"none": a.artifact}
    b = ("none-again", ["--numa", "none"]) if a.control else (
        f"distribute-{a.pseudo_nodes}-pseudo-nodes", ["--numa", "distribute", "--numa-pseudo-nodes", str(a.pseudo_nodes)])
    variants = {"none": ["--numa", "none"], b[0]: b[1]}
    artifacts[b[0]] = a.planned or a.artifact
    rates: dict[str, list[float]] = {k: [] for k in variants}
    ratios = []
    placement = {}
    for r in range(a.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        got = {}
        for k in order:
            out = worker(artifacts[k], a, *variants[k])
            got[k] = statistics.median(out["decode_tok_s"])
            placement[k] = out["numa"]
            rates[k].append(got[k])
        base, part = got["none"], got[list(variants)[1]]
        ratios.append(part / base)
        print(json.dumps({"round": r, **got, "ratio": part / base}), file=sys.stderr)
    loads: dict[str, list[dict]] = {"--no-mmap": [], "--mmap": []}
    for r in range(0 if a.control else a.rounds):
        for k in (loads if r % 2 == 0 else reversed(list(loads))):
            loads[k].append(load(a.artifact, k))
    report = {
        "decode": {k: {"tok_s_median": statistics.median(v), "tok_s": v} for k, v in rates.items()},
        "partitioned_over_none": {"median": statistics.median(ratios), "per_round": ratios},
        "placement": placement,
        "load": {k: {"load_s_median": statistics.median(x["load_s"] for x in v),
                     "max_rss_mib_median": statistics.median(x["max_rss_mib"] for x in v), "runs": v}
                 for k, v in loads.items() if v},
        "artifacts": artifacts, "ctx": a.ctx, "gen": a.gen, "threads": a.threads, "rounds": a.rounds,
    }
    return emit_report(report, a.out)


if __name__ == "__main__":
    sys.exit(main())
