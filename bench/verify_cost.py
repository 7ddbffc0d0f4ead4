"""The cost of a verification step of k tokens against a one-token decode step, k = 1..16, at several
context lengths: the curve speculative chains trade acceptance against (ellm/speculative/cost.py measures
the same once per artifact and machine for the controller).

    python bench/verify_cost.py [ARTIFACT] [--ctx 512,8000] [--max-k 16] [--rounds 7] [--threads 2] [--json FILE]

Every k at one context runs in the same rounds, alternating with decode steps, from the same position
(each step rolled back): medians over rounds, first round discarded as warm-up. k counts the tokens the
step verifies (the issue's "a step of k = 8 tokens"): a chain of k - 1 drafted tokens and the token before it.

Beside the curve, a floor: a prefill chunk's time per token at the same position (the artifact's best GEMM,
every row's dot products done once, the weights read once for the whole chunk), over a decode step. A
verification row has the same dot products to do, so k rows cost at least 1 + (k - 1) x that ratio unless
the extra rows' arithmetic hides entirely under the weight stream.
"""

from __future__ import annotations

import argparse
import json


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", nargs="?")
    ap.add_argument("--ctx", default="512,8000")
    ap.add_argument("--max-k", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk of the floor measurement")
    ap.add_argument("--json")
    a = ap.parse_args()

    import ellm
    from ellm.bench.spec_tasks import license_text
    from ellm.demo import cached_artifact
    from ellm.speculative.cost import step_times

    path = a.artifact or cached_artifact()
    ctxs = [int(c) for c in a.ctx.split(",")]
    eng = ellm.load(path, threads=a.threads, ctx_size=max(ctxs) + max(a.max_k, a.chunk) + 8)
    text = eng.tokenizer.encode(license_text())
    ids = (text * ((max(ctxs) + a.chunk) // len(text) + 1))[: max(ctxs) + a.chunk]
    report = {"artifact": str(path), "target": eng.target, "threads": a.threads, "curves": []}
    for ctx in ctxs:
        eng.reset()
        eng.prefill(ids[:ctx])
        # step_times counts drafted tokens (k + 1 rows); here k rows
        times = step_times(eng, range(0, a.max_k), rounds=a.rounds)
        rows = {k + 1: t for k, t in times.items() if k > 0}
        base = times[0]
        per_token = _chunk_time(eng, ids[ctx : ctx + a.chunk], a.rounds) / a.chunk
        floor = per_token / base
        curve = [{"k": k, "ms": t * 1e3, "x_decode": t / base, "floor": 1 + (k - 1) * floor}
                 for k, t in sorted(rows.items())]
        report["curves"].append({"ctx": ctx, "decode_ms": base * 1e3, "chunk_ms_per_token": per_token * 1e3,
                                 "chunk_token_x_decode": floor, "verify": curve})
        print(f"context {ctx}: decode {base * 1e3:.2f} ms; a {a.chunk}-token prefill chunk {per_token * 1e3:.3f} ms "
              f"a token ({floor:.3f} of a decode step); verify " +
              ", ".join(f"k={c['k']} {c['x_decode']:.2f}x (floor {c['floor']:.2f})" for c in curve))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


def _chunk_time(eng, chunk, rounds: int) -> float:
    """Median seconds of one prefill chunk at the cache's current position (rolled back after each)."""
    import time

    import numpy as np

    n, times = eng.n_cached, []
    for r in range(rounds + 1):
        t = time.perf_counter()
        eng.prefill(chunk)
        if r:  # the first is warm-up
            times.append(time.perf_counter() - t)
        eng.truncate(n)
    return float(np.median(times))


if __name__ == "__main__":
    main()
