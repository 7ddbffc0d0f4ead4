"""Per-CPU schedule search: time each kernel's knob configurations on this machine and keep the fastest.

The search covers a rule's speed-search space up to a budget (default first, then distinct points in a
seeded random order): the knobs that change the request's kernel and not its results (`Rule.space`,
`Knob.numerics`). Candidates are built as compile builds them (`Rule.build_kernel`, prefetch injection
included), and one that fails to build or run is recorded with its status. Kernels are timed by the
harness `bench/kernels.py` uses (measure.py): alone, inputs of their real shapes, one-token kernels with
their weights cold, at a representative workload (a prefill chunk of `tokens` tokens, decode at `ctx`).
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import re
import time
from typing import Callable

from ..compiler.build import CompileOptions, build_graph
from ..compiler.gguf_file import GGUFFile
from ..compiler.lower import lower
from ..config import ModelConfig
from ..models import resolve_model
from ..schedules import rule_by_name
from ..targets import TargetPreset, detect_host, resolve_target
from .database import TuningDatabase, TuningRecord
from .measure import Workload, time_kernel


def _valid(rule, req, target, knobs: dict[str, int]) -> bool:
    """Whether the rule takes these knobs for this request (some values only fit some shapes)."""
    try:
        rule.resolve_knobs(req, target, knobs)
    except ValueError:
        return False
    return True


def search_knobs(rule, req, target) -> tuple:
    """The knobs searched on speed: those that change this request's kernel and not its results."""
    return tuple(k for k in rule.space(req, target) if not k.numerics)


def candidates(rule, req, target, budget: int, seed: int = 0) -> list[dict[str, int]]:
    """The default, then distinct points of the speed-search space in a seeded random order. Knobs outside
    it (no effect on this request, or changing numerics) keep their defaults."""
    default = rule.default_knobs(req, target)
    knobs = search_knobs(rule, req, target)
    seen = {tuple(sorted(rule.canonical(req, target, default).items()))}
    others = []
    for vals in itertools.product(*[k.choices for k in knobs]):
        point = rule.canonical(req, target, {**default, **dict(zip([k.name for k in knobs], vals))})
        key = tuple(sorted(point.items()))
        if key not in seen and _valid(rule, req, target, point):
            seen.add(key)
            others.append(point)
    random.Random(seed).shuffle(others)
    return [default] + others[: max(0, budget - 1)]


def measure(rule, req, target: TargetPreset, knobs: dict[str, int], wl: Workload) -> tuple[str, float | None, str]:
    """(status, seconds, message) of one candidate, built exactly as compile builds it. A candidate that
    fails to build or to run is a status, never an exception: it must not end a tuning run."""
    try:
        func = rule.build_kernel(req, target, knobs)
    except Exception as e:  # noqa: BLE001 - any failure of a candidate's schedule is its result
        return "build_error", None, f"{type(e).__name__}: {e}"
    try:
        return "ok", time_kernel(func, req, target, wl), ""
    except Exception as e:  # noqa: BLE001
        return "run_error", None, f"{type(e).__name__}: {e}"


def tune_model(
    model,
    db_path,
    target: str = "auto",
    budget: int = 8,
    threads: int | None = None,
    workload: Workload = Workload(),
    log: Callable[[str], None] = lambda s: None,
    kernels: str | None = None,
) -> TuningDatabase:
    """Tune every kernel with searchable knobs (`kernels`: only those whose name matches this regex)."""
    from ..runtime.threads import set_threads

    preset = resolve_target(target)
    gf = GGUFFile(resolve_model(model))
    cfg = ModelConfig.from_gguf(gf)
    workload = dataclasses.replace(workload, layers=cfg.n_layers)  # attention steps through every layer's cache
    _, g = build_graph(gf, cfg, CompileOptions(target=preset.name), preset)
    pattern = re.compile(kernels) if kernels else None
    kernels = [k for k in lower(g, preset).kernels if rule_by_name(k.rule).knobs and (pattern is None or pattern.search(k.name))]
    db = TuningDatabase.open(db_path)
    host = detect_host()
    n_threads = threads or host.logical_cpus
    set_threads(n_threads)
    for info in kernels:
        rule = rule_by_name(info.rule)
        best = None
        failed, default_s = 0, 0.0
        for i, knobs in enumerate(candidates(rule, info.req, preset, budget)):
            status, seconds, message = measure(rule, info.req, preset, knobs, workload)
            if i == 0 and seconds is not None:  # the default comes first
                default_s = seconds
            rec = TuningRecord(
                preset.name, host.model_name, info.name, rule.name, knobs, seconds if seconds is not None else 0.0,
                n_threads, info.request, int(time.time()), status, message, default_s,
            )
            db.add(rec)
            if status != "ok":
                failed += 1
                log(f"{info.name:48s} {rule.name:10s} {status}: {knobs}: {message}")
            elif best is None or rec.seconds < best.seconds:
                best = rec
        if best is None:
            log(f"{info.name:48s} {rule.name:10s} no candidate ran ({failed} failed): keeps its defaults")
            continue
        log(f"{info.name:48s} {rule.name:10s} best {best.seconds * 1e6:9.1f} us  {best.knobs}"
            + (f"  ({failed} failed)" if failed else ""))
    db.save()
    return db
