"""Per-CPU schedule search: for each tunable kernel of a model, a strategy proposes points of the rule's
speed-search space (`Rule.space`: knobs that change the kernel, not its results, under the rule's
constraints), workers build them as compile does, a runner checks each against the default and times it
with the harness `bench/kernels.py` uses (measure.py), and every trial is appended to the database.

The default is trial 0 of every kernel. A search ends at its trial budget, its time budget, when the
space is exhausted, or after `patience` trials without a gain of 1% over the best. Then its fastest points
are re-timed with the default in alternation (confirm.py): compile applies a point only if it beat the
default in every round.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from ..compiler.build import CompileOptions, build_graph
from ..compiler.lower import lower
from ..compiler.source_model import open_model
from ..config import ModelConfig
from ..errors import EllmError
from ..schedules import KernelRequest, Rule, rule_by_name
from ..schedules.space import Point, Space
from ..targets import TargetPreset, detect_host, resolve_target
from .builder import BuildJob, LocalBuilder
from .confirm import CONFIRM_ROUNDS, CONFIRM_TOP, confirm, contenders
from .database import TuningDatabase, TuningRecord, versions
from .measure import Workload, decode_step_bytes
from .runner import LocalRunner, Trial
from .strategies import STRATEGIES, ModelSearch, Strategy


@dataclass(frozen=True)
class TuneOptions:
    strategy: str = "model"
    trials: int = 64  # per kernel, the default included
    time_budget: float | None = None  # seconds per kernel
    batch: int = 8  # points proposed, built in parallel, then measured one by one
    patience: int | None = 32  # trials without a 1% gain before stopping (None: never)
    seed: int = 0
    workers: int | None = None  # build processes (default: one per CPU; 0: build in this process)
    confirm: int = CONFIRM_TOP  # fastest points re-timed against the default in alternation (0: none; confirm.py)

    def __post_init__(self):
        if self.strategy not in STRATEGIES:
            raise EllmError(f"unknown search strategy {self.strategy!r} (choose from {', '.join(STRATEGIES)})")
        if self.trials < 1 or self.batch < 1 or (self.patience is not None and self.patience < 1):
            raise EllmError("tuning needs at least one trial per kernel, a batch of at least one and a positive patience")
        if self.confirm < 0:
            raise EllmError("--confirm takes the number of points to re-time (0: none)")
        if self.workers is not None and self.workers < 0:
            raise EllmError("build workers must be 0 (build in this process) or more")
        if self.time_budget is not None and self.time_budget <= 0:
            raise EllmError("the time budget must be positive")


def make_strategy(name: str, rule: Rule, req: KernelRequest, target: TargetPreset, seed: int = 0, prior=(),
                  space: Space | None = None, feature_cache: dict | None = None) -> Strategy:
    """Strategy `name` over the request's speed-search space (or `space`, a part of it); the model strategy
    describes points by their knobs and the features of the TIR they build (kept in `feature_cache`, if
    given, so that searches of one kernel lower each point once)."""
    space = space or rule.space(req, target)
    if name != "model":
        return STRATEGIES[name](space, seed)
    from .cost_model import CostModel
    from .features import tir_features

    def features(p: Point) -> list[float]:
        return space.encode(p) + tir_features(rule.build(req, target, p))

    return ModelSearch(space, seed, CostModel(seed=seed, prior=prior), features, cache=feature_cache)


@dataclass
class KernelSearch:
    """One kernel's search as it ran: (point, trial, seconds into the search) in measurement order."""

    name: str
    rule: str
    default: Point
    trials: list[tuple[Point, Trial, float]]

    def best(self) -> tuple[Point, Trial] | None:
        ok = [(p, t) for p, t, _ in self.trials if t.status == "ok"]
        return min(ok, key=lambda pt: pt[1].seconds) if ok else None


def search_kernel(name: str, rule: Rule, req: KernelRequest, target: TargetPreset, opts: TuneOptions, builder, runner,
                  on_trial: Callable[[Point, Trial, int, float, bool], None] = lambda *a: None,
                  done: Sequence[tuple[Point, Trial]] = (), prior=(), log: Callable[[str], None] = lambda s: None,
                  strategy: Strategy | None = None, prefetch: bool = True) -> KernelSearch:
    """Search one kernel. `done`: trials of an earlier run (resume), fed to the strategy first. `strategy`:
    one made by the caller (default: `opts.strategy` over the request's space). Every run measures the
    default first, resumed or not: it is the reference later candidates are checked against, and the time
    their records are compared with."""
    strategy = strategy or make_strategy(opts.strategy, rule, req, target, opts.seed, prior)
    space = strategy.space
    default = space.default
    done = [(p, t) for p, t in done if space.valid(p)]  # points this version of the rule still takes
    result = KernelSearch(name, rule.name, default, [(p, t, 0.0) for p, t in done])
    strategy.observe([(p, t.seconds if t.status == "ok" else None) for p, t in done])
    strategy.take(default)  # measured below, outside the strategy's proposals
    t0 = time.perf_counter()
    best = min((t.seconds for _, t in done if t.status == "ok"), default=None)
    since_gain = 0
    pending, first = [default], True
    while len(result.trials) < opts.trials:
        if opts.time_budget is not None and len(result.trials) > len(done) and time.perf_counter() - t0 > opts.time_budget:
            log(f"{name}: time budget reached")
            break
        if opts.patience is not None and since_gain >= opts.patience:
            log(f"{name}: no gain in {since_gain} trials: stopping early")
            break
        n = min(opts.batch, opts.trials - len(result.trials))
        points = pending + strategy.propose(n - len(pending))
        pending = []
        if not points:
            break  # the space is exhausted
        built = builder.build([BuildJob(rule.name, req, target.name, p, prefetch) for p in points])
        is_default = [i == 0 and space.key(p) == space.key(default) and first for i, p in enumerate(points)]
        first = False
        trials = runner.run_many(built, is_default) if hasattr(runner, "run_many") else \
            [runner.run(b, d) for b, d in zip(built, is_default)]
        observed = []
        for p, trial, d in zip(points, trials, is_default):
            elapsed = time.perf_counter() - t0
            result.trials.append((p, trial, elapsed))
            on_trial(p, trial, len(result.trials) - 1, elapsed, d)
            ok = trial.status == "ok"
            observed.append((p, trial.seconds if ok else None))
            if ok and (best is None or trial.seconds < best * 0.99):
                best, since_gain = trial.seconds, 0
            else:
                since_gain += 1
        strategy.observe(observed)
        if best is not None:
            log(f"{name}: {len(result.trials)}/{opts.trials} trials, best {best * 1e6:.1f} us, {time.perf_counter() - t0:.0f} s")
    return result


def tunable_kernels(model, preset: TargetPreset, compile_options: CompileOptions, kernels: str | None = None):
    """(ModelConfig, [lowered kernel info]) of the kernels with knobs, filtered by the `kernels` regex."""
    cfg, _, lowered = lowered_model(model, preset, compile_options)
    return cfg, tunable(lowered, kernels)


def lowered_model(model, preset: TargetPreset, compile_options: CompileOptions):
    """(ModelConfig, graph, [lowered kernel info]) of a model as compile lowers it for `preset`."""
    source = open_model(model)
    gf, cfg = source.gguf, source.config
    _, g = build_graph(gf, cfg, dataclasses.replace(compile_options, target=preset.name), preset)
    return cfg, g, lower(g, preset, max_chunk=compile_options.max_chunk, prefetch=compile_options.prefetch).kernels


def tunable(lowered, kernels: str | None = None) -> list:
    """The lowered kernels with knobs whose name matches the `kernels` regex (all without one)."""
    pattern = re.compile(kernels) if kernels else None
    return [k for k in lowered if rule_by_name(k.rule).knobs and (pattern is None or pattern.search(k.name))]


def model_workload(wl: Workload, cfg: ModelConfig, g) -> Workload:
    """`wl` for the model of graph `g`: attention steps through every layer's cache, and one-token kernels
    are timed at the reuse distance of its decode step at `wl.ctx` (measure.py)."""
    return dataclasses.replace(wl, layers=cfg.n_layers, step_bytes=decode_step_bytes(g, wl.ctx))


def tune_model(
    model,
    db_path,
    target: str = "auto",
    threads: int | None = None,
    workload: Workload = Workload(),
    log: Callable[[str], None] = lambda s: None,
    kernels: str | None = None,
    options: TuneOptions = TuneOptions(),
    compile_options: CompileOptions | None = None,
    resume: bool = False,
    runner=None,
    bandwidth: bool = False,
) -> TuningDatabase:
    """Tune every kernel with searchable knobs (`kernels`: only those whose name matches this regex) and
    append every trial to the database at `db_path`. `bandwidth`: measure this machine's read bandwidth first
    and record it with the run."""
    from ..numa.topology import default_threads
    from ..runtime.threads import set_threads

    preset = resolve_target(target)
    copts = dataclasses.replace(compile_options or CompileOptions(), target=preset.name)
    cfg, g, lowered = lowered_model(model, preset, copts)
    infos = tunable(lowered, kernels)
    workload = model_workload(workload, cfg, g)
    db = TuningDatabase.open(db_path)
    host = detect_host()
    n_threads = getattr(runner, "threads", None) or threads or default_threads()  # RPC: the servers' pools
    set_threads(n_threads)
    if runner is not None:
        runner.workload = workload  # with the model's layers and step bytes
    runner = runner or LocalRunner(workload)
    # the CPU the trials run on: this host's, or the RPC servers'
    cpu = (runner.cpu, runner.cpu_features) if hasattr(runner, "cpu") else (host.identity, host.compute_flags)
    run_opts = {"compile": {k: str(v) for k, v in dataclasses.asdict(copts).items()}, "workload": dataclasses.asdict(workload),
                "strategy": options.strategy, "trials": options.trials, "seed": options.seed}
    if bandwidth:  # the run's GB/s as % of it (tune report)
        from ..bench.bandwidth import measure_read_bandwidth

        run_opts["bandwidth_gbs"] = round(measure_read_bandwidth(n_threads).gb_s_median, 2)
        log(f"measured read bandwidth: {run_opts['bandwidth_gbs']} GB/s with {n_threads} threads")
    run = _Run(preset, cpu, n_threads, options.strategy, run_opts, versions(), copts.prefetch)
    with LocalBuilder(options.workers) as builder, _closing(runner):
        for i, info in enumerate(infos):
            rule = rule_by_name(info.rule)
            done = _earlier(db, preset, cpu[0], n_threads, info, rule, run_opts) if resume else []
            state = {"default": 0.0}  # this run's time of the default, which every run measures first

            def record(p: Point, trial: Trial, index: int, elapsed: float, is_default: bool, info=info, rule=rule,
                       state=state) -> None:
                if is_default and trial.status == "ok":
                    state["default"] = trial.seconds
                db.append(run.record(info, rule.name, p, trial, index, elapsed, state["default"]))
                if trial.status != "ok":
                    log(f"  {info.name}: trial {index} {trial.status}: {p}: {trial.message}")

            log(f"[{i + 1}/{len(infos)}] {info.name} ({rule.name}, {len(rule.space(info.req, preset))} points)")
            strategy = make_strategy(options.strategy, rule, info.req, preset, options.seed,
                                     space=_without_injected_prefetch(rule.space(info.req, preset), copts.prefetch))
            res = search_kernel(info.name, rule, info.req, preset, options, builder, runner, record, done, log=log,
                                strategy=strategy, prefetch=copts.prefetch)
            best = res.best()
            if best is None:
                log(f"  {info.name}: no candidate ran: keeps its defaults")
                continue
            gain = state["default"] / best[1].seconds if state["default"] else 1.0
            log(f"  {info.name}: best {best[1].seconds * 1e6:.1f} us ({gain:.2f}x the default) {best[0]}")
            if options.confirm:
                _confirm(db, run, res, rule, info, options.confirm, builder, runner, log)
    return db


@dataclass(frozen=True)
class _Run:
    """What every record of one tune run shares: the target, the CPU the trials run on (identity and compute
    features), the thread count, the strategy, the run's options and versions, and prefetch injection."""

    preset: TargetPreset
    cpu: tuple[str, list[str]]
    threads: int
    strategy: str
    options: dict
    versions: dict
    prefetch: bool

    def record(self, info, rule: str, point: Point, trial: Trial, index: int, elapsed: float,
               default_seconds: float) -> TuningRecord:
        return trial_record(self.preset, self.cpu, self.threads, info, rule, point, trial, index, elapsed,
                            default_seconds, self.strategy, self.options, self.versions)


def _confirm(db, run: _Run, res: KernelSearch, rule, info, top: int, builder, runner, log) -> None:
    """Re-time the search's `top` fastest points with the default (confirm.py) and append them as confirmed
    records."""
    pts = contenders(res.trials, res.default, top)
    if len(pts) < 2:
        return
    done = confirm(rule, info.req, run.preset, pts, builder, runner, run.prefetch)
    if not done:
        log(f"  {info.name}: the default failed when re-timed: nothing confirmed")
        return
    default_s = done[0][1].seconds
    elapsed = res.trials[-1][2] if res.trials else 0.0
    for j, (p, t) in enumerate(done[1:]):  # the default's timings are each record's default_seconds
        db.append(dataclasses.replace(run.record(info, rule.name, p, t, len(res.trials) + j, elapsed, default_s),
                                      confirmed=True))
    won = [(p, t) for p, t in done[1:] if t.stats["wins"] == t.stats["rounds"]]
    verdict = (f"best {min(t.seconds for _, t in won) * 1e6:.1f} us, {default_s / min(t.seconds for _, t in won):.2f}x"
               if won else "no point beat it in every round: keeps its defaults")
    log(f"  {info.name}: re-timed {len(done) - 1} points with the default ({default_s * 1e6:.1f} us) in "
        f"{CONFIRM_ROUNDS} alternating rounds: {verdict}")


def trial_record(preset, cpu: tuple[str, list[str]], threads: int, info, rule: str, point: Point, trial: Trial,
                 index: int, elapsed: float, default_seconds: float, strategy: str, options: dict | None = None,
                 vers: dict | None = None) -> TuningRecord:
    """The database record of one trial of kernel `info` (a lowered kernel) measured on `cpu` (its identity
    and compute features)."""
    return TuningRecord(
        preset.name, cpu[0], info.name, rule, dict(point), trial.seconds or 0.0, threads, info.request,
        int(time.time()), trial.status, trial.message, default_seconds, list(cpu[1]), trial.stats, strategy, index,
        round(elapsed, 3), trial.runner, options or {}, vers or versions(),
    )


@contextlib.contextmanager
def _closing(runner):
    try:
        yield runner
    finally:
        if hasattr(runner, "close"):
            runner.close()


def _without_injected_prefetch(space: Space, prefetch: bool) -> Space:
    """Compiled without prefetch injection, the knobs of the injected prefetches change nothing: not searched."""
    if prefetch:
        return space
    return dataclasses.replace(space, knobs=tuple(k for k in space.knobs if k.name not in ("prefetch_bytes", "prefetch_locality")))


def _earlier(db: TuningDatabase, preset, cpu: str, threads: int, info, rule, run_opts: dict) -> list[tuple[Point, Trial]]:
    """This kernel's trials already in the database for this CPU model, threads, target and workload, from
    runs with the same compile options (for --resume)."""
    out = []
    same = lambda r: (r.options.get("workload"), r.options.get("compile")) == (run_opts["workload"], run_opts["compile"])  # noqa: E731
    for r in db.trials():
        if (r.target, r.cpu, r.threads, r.kernel, r.rule) == (preset.name, cpu, threads, info.name, rule.name) and same(r):
            out.append((dict(r.knobs), Trial.from_record(r)))
    return out


__all__ = ["KernelSearch", "TuneOptions", "Workload", "search_kernel", "tune_model"]
