"""A tensor-parallel group (ellm compile --tp N) against the single-process artifact of the same model, each
measurement in its own process (ellm.bench.worker), alternating: decode tokens/s at a context, and what the
group's collectives move per token. Emits JSON.

    python bench/tensor_parallel.py SINGLE GROUP [--rounds 5] [--ctx 512] [--gen 128] [--threads 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from ellm.bench.report import emit_report


def worker(artifact: str, a, threads: int, *extra: str) -> dict:
    cmd = [sys.executable, "-m", "ellm.bench.worker", "ellm", "--artifact", artifact, "--ctx", str(a.ctx),
           "--gen", str(a.gen), "--repeat", str(a.repeat), "--threads", str(threads), *extra]
    return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("single")
    p.add_argument("group")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--gen", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2, help="CPUs: the single process's threads, the group's in all")
    p.add_argument("--out")
    a = p.parse_args()
    variants = {f"single-{a.threads}-threads": (a.single, a.threads), "single-1-thread": (a.single, 1),
                "group-shm": (a.group, a.threads, "--transport", "shm"),
                "group-tcp": (a.group, a.threads, "--transport", "tcp")}
    rates: dict[str, list[float]] = {k: [] for k in variants}
    traffic = {}
    for r in range(a.rounds):
        order = list(variants) if r % 2 == 0 else list(reversed(variants))
        got = {}
        for k in order:
            artifact, threads, *extra = variants[k]
            out = worker(artifact, a, threads, *extra)
            got[k] = statistics.median(out["decode_tok_s"])
            rates[k].append(got[k])
            if "collectives_per_token" in out:
                traffic[k] = out["collectives_per_token"]
        print(json.dumps({"round": r, **got}), file=sys.stderr)
    base = f"single-{a.threads}-threads"
    report = {
        "decode": {k: {"tok_s_median": statistics.median(v), "tok_s": v} for k, v in rates.items()},
        "group_over_single": {k: statistics.median(g / s for g, s in zip(rates[k], rates[base]))
                              for k in ("group-shm", "group-tcp")},
        "group_collectives_per_token": traffic,
        "ctx": a.ctx, "gen": a.gen, "threads": a.threads, "rounds": a.rounds,
    }
    return emit_report(report, a.out)


if __name__ == "__main__":
    sys.exit(main())
