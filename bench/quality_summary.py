"""Search quality over many kernels and hosts: the results of several `bench/search_quality.py --json` runs,
merged into one table and one set of curves.

Each input holds, per kernel, every strategy's best-so-far curve for every seed (fraction of the sweep's
best after each trial). Per kernel, a strategy's curve is the median over its seeds; over kernels, this
reports the median and the lowest of those curves at each trial, which is how the tuner is judged (the
median over kernels of the fraction reached in 64 trials).

    python bench/quality_summary.py docs/runs/sq-*/quality*.json [--trials 64] [--json out.json] [--plot F.png]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

CHECKPOINTS = (8, 16, 32, 48, 64)


def kernel_curves(path: Path) -> list[dict]:
    """Per kernel of one search_quality result: its name, host target, sizes and each strategy's curve (the
    median over seeds of the fraction of the sweep's best after each trial)."""
    d = json.loads(path.read_text())
    out = []
    for k in d["kernels"]:
        curves = {}
        for name, s in k["strategies"].items():
            seeds = [c for c in s["curves"] if c]
            n = min(len(c) for c in seeds)
            curves[name] = [statistics.median(c[t] for c in seeds) for t in range(n)]
        out.append({"file": str(path), "target": d["target"], "kernel": k["kernel"], "rule": k["rule"],
                    "space": k["space"], "swept": k["swept"], "curves": curves})
    return out


def summarize(kernels: list[dict], trials: int) -> dict:
    """Per strategy, at each trial up to `trials`: the median and the lowest fraction over kernels."""
    names = sorted({s for k in kernels for s in k["curves"]})
    out = {}
    for s in names:
        have = [k["curves"][s] for k in kernels if s in k["curves"]]
        n = min(trials, min(len(c) for c in have))
        out[s] = {"kernels": len(have),
                  "median": [statistics.median(c[t] for c in have) for t in range(n)],
                  "lowest": [min(c[t] for c in have) for t in range(n)]}
    return out


def table(kernels: list[dict], summary: dict, trials: int) -> str:
    names = sorted(summary)
    lines = [f"{'target':15s} {'kernel':44s} {'space':>6s} {'swept':>6s} " + " ".join(f"{s:>12s}" for s in names)]
    for k in kernels:
        cells = [f"{k['curves'][s][min(trials, len(k['curves'][s])) - 1]:12.3f}" if s in k["curves"] else f"{'-':>12s}"
                 for s in names]
        lines.append(f"{k['target']:15s} {k['kernel']:44s} {k['space']:6d} {k['swept']:6d} " + " ".join(cells))
    for what in ("median", "lowest"):
        cells = [f"{summary[s][what][-1]:12.3f}" for s in names]
        lines.append(f"{what + f' over {len(kernels)} kernels':74s} " + " ".join(cells))
    lines.append("")
    lines.append("median over kernels after " + ", ".join(str(t) for t in CHECKPOINTS if t <= trials) + " trials:")
    for s in names:
        m = summary[s]["median"]
        lines.append(f"  {s:12s} " + " ".join(f"{m[t - 1]:.3f}" for t in CHECKPOINTS if t <= len(m)))
    return "\n".join(lines)


def plot(summary: dict, kernels: int, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (s, v) in enumerate(sorted(summary.items())):
        x = range(1, len(v["median"]) + 1)
        ax.plot(x, v["median"], color=palette[i % len(palette)], label=f"{s} (median)")
        ax.plot(x, v["lowest"], color=palette[i % len(palette)], linestyle=":", alpha=0.7, label=f"{s} (lowest kernel)")
    ax.axhline(0.97, color="grey", linewidth=0.8)
    ax.set_xlabel("trials")
    ax.set_ylabel("best so far / best of the sweep")
    ax.set_ylim(0.6, 1.01)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, ncol=2)
    ax.set_title(f"eLLM schedule search over {kernels} kernels (median of 5 seeds per kernel)")
    fig.tight_layout()
    tmp = Path(path + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+", help="search_quality.py --json files")
    ap.add_argument("--trials", type=int, default=64)
    ap.add_argument("--json", help="write the merged table and curves here")
    ap.add_argument("--plot", metavar="FILE.png", help="draw the median and lowest curve per strategy (needs matplotlib)")
    a = ap.parse_args(argv)
    kernels = [k for f in a.results for k in kernel_curves(Path(f))]
    if not kernels:
        raise SystemExit("no kernels in these results")
    summary = summarize(kernels, a.trials)
    print(table(kernels, summary, a.trials))
    if a.json:
        from ellm.fsutil import atomic_write_text

        atomic_write_text(a.json, json.dumps({"kernels": kernels, "summary": summary}, indent=1))
    if a.plot:
        plot(summary, len(kernels), a.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
