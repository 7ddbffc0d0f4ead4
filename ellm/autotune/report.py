"""`ellm tune report DB`: what a tuning database says, for people studying schedule search.

Per kernel (and CPU model, threads): the default's and the best time, GB/s and % of the measured memory
bandwidth where the run recorded bytes per call and bandwidth, the speedup, how many trials each
strategy needed to reach 95% of the best it found, and, where the tune confirmed its best points
(confirm.py), the confirmed speedup and whether compile applies it. Per strategy: best-so-far curves (speedup over the
default) against trials and against wall time, each search's trials in the order they ran.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

from .database import TuningDatabase, TuningRecord


def _searches(db: TuningDatabase) -> dict[tuple, list[TuningRecord]]:
    """Trials grouped by (kernel, rule, target, CPU, threads, strategy), in trial order (the search's own:
    confirmations are re-timings, reported per kernel)."""
    out: dict[tuple, list[TuningRecord]] = defaultdict(list)
    for r in db.trials():
        if not r.confirmed:
            out[(r.kernel, r.rule, r.target, r.cpu, r.threads, r.strategy or "?")].append(r)
    for v in out.values():
        v.sort(key=lambda r: (r.trial, r.measured_unix))
    return out


def curve(trials: list[TuningRecord]) -> list[dict]:
    """Best-so-far after each trial: seconds, speedup over the default, wall time into the search."""
    default = next((r.default_seconds for r in trials if r.default_seconds > 0), 0.0)
    best, out = None, []
    for r in trials:
        if r.status == "ok" and (best is None or r.seconds < best):
            best = r.seconds
        out.append({"trial": r.trial, "elapsed_s": r.elapsed_s, "best_s": best,
                    "speedup": default / best if best and default else None})
    return out


def trials_to(trials: list[TuningRecord], fraction: float = 0.95) -> int | None:
    """Trials until the best-so-far is within `fraction` of the search's own best (speed, not time)."""
    c = curve(trials)
    final = c[-1]["best_s"] if c else None
    if not final:
        return None
    return next(i + 1 for i, p in enumerate(c) if p["best_s"] and final / p["best_s"] >= fraction)


def build_report(db: TuningDatabase) -> dict:
    searches = _searches(db)
    kernels: dict[tuple, dict] = {}
    for (kernel, rule, target, cpu, threads, strategy), trials in sorted(searches.items()):
        k = kernels.setdefault((kernel, rule, target, cpu, threads), {
            "kernel": kernel, "rule": rule, "target": target, "cpu": cpu, "threads": threads, "strategies": {}})
        ok = [r for r in trials if r.status == "ok"]
        best = min(ok, key=lambda r: r.seconds) if ok else None
        default = next((r.default_seconds for r in trials if r.default_seconds > 0), 0.0)
        k["strategies"][strategy] = {
            "trials": len(trials), "failed": len(trials) - len(ok), "best_s": best.seconds if best else None,
            "default_s": default or None, "speedup": default / best.seconds if best and default else None,
            "trials_to_95": trials_to(trials), "best_knobs": best.knobs if best else None, "curve": curve(trials),
        }
        if best is not None and (k.get("best_s") is None or best.seconds < k["best_s"]):
            nbytes = best.stats.get("bytes", 0)
            bw = best.options.get("bandwidth_gbs") if isinstance(best.options, dict) else None
            gbs = nbytes / best.seconds / 1e9 if nbytes else None
            k.update(best_s=best.seconds, default_s=default or None, speedup=default / best.seconds if default else None,
                     gbs=gbs, pct_bandwidth=100 * gbs / bw if gbs and bw else None, best_knobs=best.knobs)
    for rec in db.records():  # what compile applies: with confirmations, their verdict
        k = kernels.get((rec.kernel, rec.rule, rec.target, rec.cpu, rec.threads))
        if k is not None and rec.confirmed:
            k["confirmed"] = {"default_s": rec.default_seconds, "best_s": rec.seconds, "speedup": rec.gain(),
                              "wins": rec.stats.get("wins"), "rounds": rec.stats.get("rounds"),
                              "applied": rec.beats_default(), "knobs": rec.knobs}
    return {"kernels": list(kernels.values())}


def format_report(rep: dict) -> str:
    lines = [f"{'kernel':44s} {'rule':16s} {'default us':>10s} {'best us':>9s} {'GB/s':>6s} {'%BW':>5s} {'speedup':>7s}  "
             "confirmed  trials to 95% (per strategy)"]
    for k in rep["kernels"]:
        f = lambda v, w, p: f"{v:{w}.{p}f}" if v is not None else f"{'-':>{w}s}"  # noqa: E731
        t95 = ", ".join(f"{s} {v['trials_to_95']}/{v['trials']}" for s, v in sorted(k["strategies"].items()))
        c = k.get("confirmed")
        conf = (f"{c['speedup']:.3f}{'' if c['applied'] else ' no'}" if c else "-").rjust(9)
        lines.append(f"{k['kernel'][:44]:44s} {k['rule'][:16]:16s} {f((k.get('default_s') or 0) * 1e6 or None, 10, 1)} "
                     f"{f((k.get('best_s') or 0) * 1e6 or None, 9, 1)} {f(k.get('gbs'), 6, 1)} {f(k.get('pct_bandwidth'), 5, 0)} "
                     f"{f(k.get('speedup'), 7, 3)} {conf}  {t95}")
    return "\n".join(lines)


def plot_report(rep: dict, path: str | Path) -> None:
    """Best-so-far speedup over the default against trials (left) and wall time (right), one line per search."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    colors: dict[str, str] = {}
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k in rep["kernels"]:
        for s, v in sorted(k["strategies"].items()):
            c = colors.setdefault(s, palette[len(colors) % len(palette)])
            pts = [(p["trial"] + 1, p["elapsed_s"], p["speedup"]) for p in v["curve"] if p["speedup"]]
            if not pts:
                continue
            label = s if s not in {ln.get_label() for ln in a.get_lines()} else None
            a.plot([p[0] for p in pts], [p[2] for p in pts], color=c, alpha=0.6, label=label)
            b.plot([p[1] for p in pts], [p[2] for p in pts], color=c, alpha=0.6)
    a.set_xlabel("trials")
    b.set_xlabel("seconds into the search")
    for ax in (a, b):
        ax.set_ylabel("best so far / default speed")
        ax.grid(alpha=0.3)
    a.legend()
    fig.suptitle("eLLM schedule search: best-so-far per kernel and strategy")
    fig.tight_layout()
    tmp = Path(str(path) + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


__all__ = ["build_report", "curve", "format_report", "plot_report", "trials_to"]
