"""How much prompt-lookup speculation could gain on the task set, and how much the controller gets of it,
in units of decode steps: the greedy output of every task is recorded once, then replayed.

    python bench/spec_bound.py [ARTIFACT] [--ctx 2048,8000] [--gen 256] [--threads 2] [--json FILE]

For every position of the output, the n-gram drafter's draft is known, and so is how many of its tokens the
model would accept (the greedy output is the model's). The bound: a clairvoyant controller that verifies
exactly the tokens that will be accepted, chosen by dynamic programming over the artifact's verification
cost curve (speculative/cost.py) — no controller can do better with these drafts at these costs. The replay:
the real ChainController, fed the same acceptances and shadow checks as in a run, its cost slope fixed at the
curve's. Both are tokens per decode step of cost; `--inflate F` scales the curve's excess over one decode
step, for verification steps that cost more in a run than in isolation.
"""

from __future__ import annotations

import argparse
import json


def accepted_lengths(prompt: list[int], out: list[int], chain: int, n_max: int = 4) -> list[tuple[list[int], int, int]]:
    """Per position i (out[:i+1] chosen): (draft, n-gram match length, drafted tokens the model accepts)."""
    from ellm.speculative.ngram import NgramIndex

    index = NgramIndex(n_max, 1, prompt)
    rows = []
    for i, tok in enumerate(out):
        index.append(tok)
        draft, matched = index.propose(chain)
        n = 0
        while n < len(draft) and i + 1 + n < len(out) and draft[n] == out[i + 1 + n]:
            n += 1
        rows.append((draft, matched, n))
    return rows


def bound(rows, curve: list[float]) -> float:
    """Tokens after the first per unit of cost, verifying exactly what will be accepted (best over all
    chain choices)."""
    n = len(rows)
    best = [0.0] * n  # best[i]: least cost to produce out[i+1:]
    for i in range(n - 2, -1, -1):
        c = 1.0 + best[i + 1]
        for k in range(1, rows[i][2] + 1):
            c = min(c, curve[k] + best[min(i + k + 1, n - 1)])
        best[i] = c
    return (n - 1) / best[0] if best[0] else float("nan")


def replay(rows, out: list[int], curve: list[float], chain: int) -> float:
    """Tokens after the first per unit of cost under the ChainController, as run_chain drives it."""
    from ellm.speculative.controller import ChainController

    ctl = ChainController(curve, chain)
    n, i, cost = len(out), 0, 0.0
    while i < n - 1:
        room = min(n - 2 - i, chain)
        draft, matched, _ = rows[i]
        draft = draft[:room] if room > 0 else []
        key = ("ngram", matched)
        k = ctl.length(key, len(draft)) if draft else 0
        if k == 0:
            cost += 1.0
            if draft:
                ctl.shadow(key, draft[0] == out[i + 1])
            i += 1
            continue
        a = min(rows[i][2], k)
        cost += curve[k]
        ctl.accepted(key, k, a)
        i += a + 1
    return (n - 1) / cost


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("artifact", nargs="?")
    ap.add_argument("--ctx", default="2048,8000")
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--chain", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--inflate", type=float, default=1.0)
    ap.add_argument("--json")
    a = ap.parse_args()

    import ellm
    from ellm.bench.spec_tasks import TASKS
    from ellm.demo import cache_root, cached_artifact
    from ellm.speculative.cost import load_or_measure

    path = a.artifact or cached_artifact()
    report = {"artifact": str(path), "chain": a.chain, "inflate": a.inflate, "tasks": []}
    for ctx in (int(c) for c in a.ctx.split(",")):
        eng = ellm.load(path, threads=a.threads, ctx_size=ctx + a.gen + 600)
        curve = load_or_measure(eng, cache_root(), eng.max_verify)
        curve = [1.0] + [1.0 + (c - 1.0) * a.inflate for c in curve[1:]]
        for t in TASKS:
            ids = t.prompt(eng.tokenizer, ctx)
            out = eng.generate(ids, a.gen, cache_reuse=False)
            rows = accepted_lengths(ids, out, a.chain)
            r = {"task": t.name, "grounded": t.grounded, "ctx": ctx, "prompt_tokens": len(ids), "tokens": len(out),
                 "bound": bound(rows, curve), "controller": replay(rows, out, curve, a.chain),
                 "draft_hits": sum(1 for _, _, n in rows if n > 0) / len(rows)}
            report["tasks"].append(r)
            print(f"{t.name:10s} {ctx:5d}: bound {r['bound']:.2f}x, controller {r['controller']:.2f}x "
                  f"({100 * r['controller'] / r['bound']:.0f}% of it), first drafted token right at "
                  f"{100 * r['draft_hits']:.0f}% of positions", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
