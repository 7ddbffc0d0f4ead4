"""The cost of a verification step of k tokens against a one-token decode step, k = 1..16, at several
context lengths: the curve speculative chains trade acceptance against (ellm/speculative/cost.py measures
the same once per artifact and machine for the controller).

    python bench/verify_cost.py [ARTIFACT] [--ctx 512,8000] [--max-k 16] [--rounds 7] [--threads 2] [--json FILE]

Every k at one context runs in the same rounds, alternating with decode steps, from the same position
(each step rolled back): medians over rounds, first round discarded as warm-up. k counts the tokens the
step verifies (the issue's "a step of k = 8 tokens"): a chain of k - 1 drafted tokens and the token before it.
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
    ap.add_argument("--json")
    a = ap.parse_args()

    import ellm
    from ellm.bench.spec_tasks import license_text
    from ellm.demo import cached_artifact
    from ellm.speculative.cost import step_times

    path = a.artifact or cached_artifact()
    ctxs = [int(c) for c in a.ctx.split(",")]
    eng = ellm.load(path, threads=a.threads, ctx_size=max(ctxs) + a.max_k + 8)
    text = eng.tokenizer.encode(license_text())
    ids = (text * (max(ctxs) // len(text) + 1))[: max(ctxs)]
    report = {"artifact": str(path), "target": eng.target, "threads": a.threads, "curves": []}
    for ctx in ctxs:
        eng.reset()
        eng.prefill(ids[:ctx])
        # step_times counts drafted tokens (k + 1 rows); here k rows
        times = step_times(eng, range(0, a.max_k), rounds=a.rounds)
        rows = {k + 1: t for k, t in times.items() if k > 0}
        base = times[0]
        curve = [{"k": k, "ms": t * 1e3, "x_decode": t / base} for k, t in sorted(rows.items())]
        report["curves"].append({"ctx": ctx, "decode_ms": base * 1e3, "verify": curve})
        print(f"context {ctx}: decode {base * 1e3:.2f} ms; verify " +
              ", ".join(f"k={c['k']} {c['x_decode']:.2f}x" for c in curve))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
