"""Per-CPU schedule search: time each kernel's knob configurations on this machine and keep the fastest.

The search covers a rule's speed-search space up to a budget (default first, then distinct points in a
seeded random order): the knobs that change the request's kernel and not its results (`Rule.space`,
`Knob.numerics`). Candidates are built as compile builds them (`Rule.build_kernel`, prefetch injection
included), and one that fails to build or run is recorded with its status. Kernels are timed alone with
random inputs of their real shapes, symbolic sizes bound to a representative workload: a prefill chunk
of `tokens` tokens and decode at `ctx` context.
"""

from __future__ import annotations

import itertools
import random
import re
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..compiler.build import CompileOptions, build_graph
from ..compiler.gguf_file import GGUFFile
from ..compiler.lower import lower
from ..config import ModelConfig
from ..models import resolve_model
from ..schedules import KernelRequest, rule_by_name
from ..targets import TargetPreset, detect_host, resolve_target
from ..kv.attention import AttentionConfig
from ..kv.plan import KVPlan
from .database import TuningDatabase, TuningRecord


@dataclass(frozen=True)
class Workload:
    tokens: int = 256  # symbolic token count of prefill kernels
    ctx: int = 4096  # KV cache capacity; attention runs at the end of it


def _inputs(func, req: KernelRequest, wl: Workload, rng) -> list:
    """Random TVM arguments for every parameter of `func` (buffers and scalars)."""
    import tvm

    m = req.m if req.m is not None else wl.tokens
    key = req.attr("kv_plan")
    block = KVPlan.from_key(key).block if key else 64
    sizes = {"T": m, "n": m, "C": wl.ctx, "NB": -(-wl.ctx // block)}  # NB: KV cache blocks
    # a chunk ends at the cache's end and stores the blocks it completes; a one-token step stores a block
    # only once every `block` steps, so it is timed at a position that completes none
    pos = wl.ctx - m
    if m == 1 and (pos + 1) % block == 0:
        pos -= 1
    args = []
    for p in func.params:
        if not isinstance(p.ty, tvm.ir.PrimType):  # a buffer parameter
            shape = [int(d) if isinstance(d, (int, tvm.tirx.IntImm)) else sizes[str(d.name)] for d in p.shape]
            dtype = str(p.dtype)
            if str(p.name) == "attn":  # the run-time attention settings: the defaults, as a run has them
                arr = AttentionConfig().as_array()
            elif dtype.startswith("float"):
                arr = (rng.standard_normal(shape) * 0.1).astype(dtype)
            elif dtype == "int32":  # token ids
                arr = np.zeros(shape, np.int32)
            else:  # packed quants, scales as raw bytes
                nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
                arr = rng.integers(0, 256, nbytes, dtype=np.uint8).view(dtype).reshape(shape)
            args.append(tvm.runtime.tensor(arr))
        else:
            args.append({"pos": pos, "layer": 0, "kslot": 0, "vslot": 0}[str(p.name)])
    return args


def time_kernel(func, req: KernelRequest, target: TargetPreset, wl: Workload, repeat: int = 5) -> float:
    """Median seconds per call of one kernel (a PrimFunc as `Rule.build_kernel` returns it)."""
    import tvm

    ex = tvm.compile(func.with_attr("global_symbol", "kernel"), target=target.tvm_target())
    args = _inputs(func, req, wl, np.random.default_rng(0))
    timer = ex.mod.time_evaluator("kernel", tvm.cpu(), number=1, repeat=repeat, min_repeat_ms=30)
    return statistics.median(timer(*args).results)


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
