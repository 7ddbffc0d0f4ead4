"""Search quality of the tuner's strategies, per kernel: how close 64 trials get to the best of a sweep.

Phase 1 measures each kernel's landscape on this machine with the tuner's own builder and runner: every
point of its speed-search space where it has at most --sweep points, else --sweep distinct random points
(the default always among them), measured in random order. Every measurement is appended to a tuning
database (strategy "sweep"); a sweep interrupted resumes from it.
The sweep's fastest points are then re-timed, alternating, and keep the median of all their timings: the
minimum of hundreds of noisy timings is biased low, and a strategy would be judged against that luck.
Each kernel's landscape (point, seconds) is written to --landscapes; --replay reads one instead of measuring.
Phase 2 replays each strategy on the measured landscape (the space restricted to the swept points, so a
proposal's time is its measured time) with several seeds: best-so-far after each trial, relative to the
sweep's best. Replays make many seeds cheap; the times they read are real measurements of one run.

    python bench/search_quality.py [MODEL] --kernels REGEX --sweep 512 --trials 64 --seeds 5 --json out.json \
        --landscapes landscapes.json        # or --replay landscapes.json: strategies only, nothing measured
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import sys
import time
from pathlib import Path

from ellm.autotune import STRATEGIES, LocalBuilder, LocalRunner, TuneOptions, TuningDatabase
from ellm.autotune.measure import Workload
from ellm.autotune.replay import Landscape, best_so_far, restricted
from ellm.autotune.tuner import lowered_model, make_strategy, model_workload, search_kernel, trial_record, tunable
from ellm.compiler.build import CompileOptions
from ellm.fsutil import atomic_write_text
from ellm.runtime.threads import set_threads
from ellm.schedules import rule_by_name
from ellm.schedules.space import Space
from ellm.targets import detect_host, resolve_target


CHECKPOINTS = (1, 8, 16, 32, 48, 64)  # trials at which the JSON gives the median fraction of the best


def sweep_points(space: Space, n: int, seed: int) -> list[dict]:
    pts = list(space.points())
    if len(pts) <= n:
        return pts
    rng = random.Random(seed)
    rest = [p for p in pts if space.key(p) != space.key(space.default)]
    return [space.default] + rng.sample(rest, n - 1)


def measure_landscape(info, preset, points, builder, runner, db, host, threads, wl, log) -> tuple[dict, int]:
    """(key -> seconds (None: failed) for every point, how many came from an earlier run). Points are
    measured in random order (the default first): in grid order, the VM's drifting bandwidth would
    correlate with the knobs. Points this host measured
    for this kernel in an earlier sweep into `db` (same threads, workload, eLLM and TVM versions) are kept,
    so an interrupted sweep resumes; the default is measured again in every run."""
    rule = rule_by_name(info.rule)
    space = restricted(rule.space(info.req, preset), {Space.key(p) for p in points}, "chosen for the sweep")
    run_opts = {"workload": dataclasses.asdict(wl)}
    latest = {space.key(p): (p, t) for p, t in sweep_trials(db, preset, host, threads, info, rule, run_opts)
              if space.valid(p)}  # a point measured by several runs (the default): its latest time
    done = list(latest.values())
    if done:
        log(f"  {len(done)} points measured by an earlier sweep into {db.path}: resuming")
    opts = TuneOptions("random", trials=len(done) + len(points), batch=8, patience=None)  # stops when none are left
    table: dict = {space.key(p): (t.seconds if t.status == "ok" else None) for p, t in done}
    default_s = [0.0]

    def on_trial(p, trial, index, elapsed, is_default):
        if is_default and trial.status == "ok":
            default_s[0] = trial.seconds
        table[space.key(p)] = trial.seconds if trial.status == "ok" else None
        db.append(trial_record(preset, (host.identity, host.compute_flags), threads, info, rule.name, p, trial, index,
                               elapsed, default_s[0], "sweep", run_opts))

    search_kernel(info.name, rule, info.req, preset, opts, builder, runner, on_trial, done=done, log=log,
                  strategy=STRATEGIES["random"](space, seed=1))
    return table, len(done)


def sweep_trials(db, preset, host, threads, info, rule, run_opts: dict) -> list:
    """(point, trial) of this kernel's sweep records measured on this host with `threads`, this workload and
    these eLLM and TVM versions, oldest first."""
    from ellm.autotune.database import versions
    from ellm.autotune.runner import Trial

    return [(dict(r.knobs), Trial.from_record(r))
            for r in db.trials()
            if r.strategy == "sweep" and r.options.get("workload") == run_opts["workload"] and r.versions == versions()
            and (r.target, r.cpu, r.threads, r.kernel, r.rule) == (preset.name, host.identity, threads, info.name, rule.name)]


def retime_top(info, preset, points, table: dict, builder, runner, top: int, rounds: int, log, passes: int = 4) -> None:
    """Re-time the `top` fastest points of the sweep `rounds` times, alternating, and give each the median
    of its timings (the sweep's included). While the fastest point is then one not re-timed (the re-timed
    ones came out slower: their sweep times were lucky, or the VM slowed), the next `top` fastest are
    re-timed too, at most `passes` times: the best is never one timing."""
    from ellm.autotune.builder import BuildJob

    rule = rule_by_name(info.rule)
    by_key = {Space.key(p): p for p in points}
    times: dict = {}
    minimum = min(t for t in table.values() if t is not None)
    for _ in range(passes):
        fresh = [k for _, k in sorted((t, k) for k, t in table.items() if t is not None and k not in times)[:top]]
        built = builder.build([BuildJob(rule.name, info.req, preset.name, by_key[k]) for k in fresh])
        for k in fresh:
            times[k] = [table[k]]
        for _ in range(rounds):
            for k, b in zip(fresh, built):
                trial = runner.run(b)
                if trial.status == "ok":
                    times[k].append(trial.seconds)
        for k in fresh:
            table[k] = statistics.median(times[k])
        if min((t, k) for k, t in table.items() if t is not None)[1] in times:
            break
    best = min(table[k] for k in times)
    log(f"  re-timed the {len(times)} fastest {rounds} times: best {best * 1e6:.1f} us (sweep minimum {minimum * 1e6:.1f} us)"
        + ("" if best == min(t for t in table.values() if t is not None) else ", a point timed once is still faster"))


def replay(info, preset, table: dict, strategy: str, trials: int, seed: int, patience: int | None,
           feature_cache: dict) -> list[float]:
    """Best-so-far seconds after each trial of `strategy` on the measured landscape, searched as `ellm tune`
    searches (the default first, batches of 8)."""
    rule = rule_by_name(info.rule)
    land = Landscape(rule.space(info.req, preset), table)
    s = make_strategy(strategy, rule, info.req, preset, seed, space=land.space, feature_cache=feature_cache)
    opts = TuneOptions(strategy, trials=trials, patience=patience, seed=seed)
    curve = best_so_far(search_kernel(info.name, rule, info.req, preset, opts, land, land, strategy=s))
    return curve + curve[-1:] * (trials - len(curve))  # stopped early: the best stays


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?")
    ap.add_argument("--target", default="auto")
    ap.add_argument("--kernels", default=None, help="regex of kernel names")
    ap.add_argument("--sweep", type=int, default=512)
    ap.add_argument("--trials", type=int, default=64)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--ctx", type=int, default=4096)
    ap.add_argument("--db", default="search_quality.jsonl", help="tuning database the sweep appends to")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument("--landscapes", default=None, help="write every kernel's measured landscape here")
    ap.add_argument("--replay", default=None, help="replay the strategies on these landscapes (nothing is measured)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="comma-separated strategies to replay")
    ap.add_argument("--patience", type=int, default=None, help="replays stop after this many trials without a 1%% gain")
    ap.add_argument("--retime", type=int, default=16, help="fastest points of a sweep re-timed")
    a = ap.parse_args(argv)

    preset = resolve_target(a.target)
    cfg, g, lowered = lowered_model(a.model, preset, CompileOptions(target=preset.name))
    infos = tunable(lowered, a.kernels)
    host = detect_host()
    threads = a.threads or host.logical_cpus
    set_threads(threads)
    wl = model_workload(Workload(ctx=a.ctx), cfg, g)
    db = TuningDatabase.open(a.db)
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    out = {"host": host.record(), "target": preset.name, "threads": threads, "trials": a.trials, "seeds": a.seeds, "kernels": []}
    stored = json.loads(Path(a.replay).read_text())["kernels"] if a.replay else {}
    landscapes = {"host": host.record(), "target": preset.name, "threads": threads, "workload": dataclasses.asdict(wl),
                  "kernels": dict(stored)}
    if a.landscapes and not a.replay and Path(a.landscapes).exists():  # resume: kernels swept already are kept
        earlier = json.loads(Path(a.landscapes).read_text())
        if earlier.get("workload") == landscapes["workload"]:
            landscapes["kernels"] = earlier["kernels"]
        else:  # timed at another context or reuse distance (or before landscapes recorded theirs)
            raise SystemExit(f"{a.landscapes} was measured with another workload ({earlier.get('workload')}): "
                             f"name a new --landscapes file")
    with LocalBuilder() as builder:
        runner = LocalRunner(wl)
        for info in infos:
            rule = rule_by_name(info.rule)
            space = rule.space(info.req, preset)
            if len(space) < 2 or (a.replay and info.name not in stored):
                continue
            t0 = time.time()
            if a.replay or info.name in landscapes["kernels"]:
                kept = landscapes["kernels"][info.name]
                table = {space.key(p): t for p, t in kept["points"]}
                swept, sweep_s = len(table), kept["sweep_s"]
                log(f"{info.name}: {swept} points from {a.replay or a.landscapes}")
            else:
                pts = sweep_points(space, a.sweep, 0)
                log(f"{info.name} ({rule.name}): sweeping {len(pts)} of {len(space)} points")
                table, resumed = measure_landscape(info, preset, pts, builder, runner, db, host, threads, wl, log)
                if any(t is not None for t in table.values()):
                    retime_top(info, preset, pts, table, builder, runner, a.retime, 3, log)
                swept, sweep_s = len(pts), time.time() - t0
                # sweep_s: this run's time; `resumed` points were measured by earlier ones
                landscapes["kernels"][info.name] = {"rule": rule.name, "sweep_s": sweep_s, "resumed": resumed,
                                                    "points": [[p, table[space.key(p)]] for p in pts]}
                if a.landscapes:
                    atomic_write_text(a.landscapes, json.dumps(landscapes))
            ok = [t for t in table.values() if t is not None]
            if not ok:
                continue
            best, default = min(ok), table.get(space.key(space.default))
            k = {"kernel": info.name, "rule": rule.name, "space": len(space), "swept": swept, "sweep_s": sweep_s,
                 "best_s": best, "default_s": default, "strategies": {}}
            feature_cache: dict = {}
            for name in a.strategies.split(","):
                curves = [replay(info, preset, table, name, a.trials, seed, a.patience, feature_cache) for seed in range(a.seeds)]
                final = [best / c[-1] for c in curves if c and c[-1]]
                fractions = [[best / x if x else 0.0 for x in c] for c in curves]
                k["strategies"][name] = {
                    "median_fraction_of_best": statistics.median(final) if final else 0.0,
                    "median_at_trials": {n: statistics.median(f[n - 1] for f in fractions)
                                         for n in CHECKPOINTS if n <= a.trials},
                    "curves": fractions,
                }
                log(f"  {name:12s} {statistics.median(final) if final else 0:.3f} of the sweep's best after {a.trials} trials")
            out["kernels"].append(k)
    for name in a.strategies.split(","):
        vals = [k["strategies"][name]["median_fraction_of_best"] for k in out["kernels"]]
        out.setdefault("median_over_kernels", {})[name] = statistics.median(vals) if vals else 0.0
    if a.json:
        atomic_write_text(a.json, json.dumps(out, indent=1))
    print(json.dumps(out["median_over_kernels"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
