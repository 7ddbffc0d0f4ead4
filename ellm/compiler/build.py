"""`ellm compile`: GGUF -> graph -> passes -> TVM kernels + Relax VM, per target -> one artifact directory
(atomically). Several targets share one weights file wherever their parameter layouts agree."""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Callable

from .. import __version__
from ..errors import EllmError
from ..fsutil import atomic_directory
from ..kv.attention import AttentionConfig
from ..kv.plan import parse_kv_type
from ..precision import Budget
from ..runtime.artifact import TOKENIZER, WEIGHTS
from ..targets import TargetPreset, resolve_target
from .artifact import write_manifest, write_weights
from .compile_target import (TargetBuild, TargetOptions, build_graph, compile_target, kv_store_fields, pass_context,
                             precision_plan)
from .lower import ENTRIES, MAX_VERIFY, ParamSpec
from .pack_weights import pack_params
from .pass_context import ACTIVATIONS
from .pipeline import REQUIRED, pass_names
from .source_model import open_model

__all__ = ["CompileOptions", "CompileReport", "build_graph", "compile_model", "pass_context"]


@dataclass(frozen=True)
class CompileOptions(TargetOptions):
    # a preset name, "auto" (this host's), or several separated by commas: one artifact with a kernel library
    # per target, the best one this CPU can run chosen at load
    target: str = "auto"
    tuning_db: Path | None = None

    def __post_init__(self) -> None:
        if self.activations not in ("auto", *ACTIVATIONS):
            raise EllmError(f"activations must be auto, {', '.join(ACTIVATIONS)}; got {self.activations!r}")
        if not 1 <= self.max_chunk <= 65536:
            raise EllmError(f"max_chunk must be between 1 and 65536, got {self.max_chunk}")
        for t in (self.cache_type_k, self.cache_type_v):
            parse_kv_type(t)
        kv_store_fields(self.kv_store)
        if REQUIRED & set(self.disable_passes):
            raise EllmError(f"pass(es) {sorted(REQUIRED & set(self.disable_passes))} cannot be disabled")
        unknown = (set(self.disable_passes) | set(self.enable_passes)) - set(pass_names())
        if unknown:
            raise EllmError(f"unknown pass(es) {sorted(unknown)}; passes are: {', '.join(pass_names())}")
        if self.quant_level is not None and self.quant_level not in (0, 1, 2):
            raise EllmError(f"--quant-level must be 0, 1 or 2, got {self.quant_level}")
        if self.precision not in (None, "source", "auto"):
            raise EllmError(f"--precision must be source or auto, got {self.precision!r}")
        if self.precision is not None and self.quant_level is not None:
            raise EllmError(f"--precision {self.precision} and --quant-level are both precision recipes: pick one")
        if (self.budget_mb is not None or self.budget_ratio is not None) and (
                self.precision == "source" or self.quant_level is not None):
            raise EllmError("--budget-mb and --budget-ratio need the measured plan (--precision auto, the default), "
                            "not --precision source or --quant-level")
        Budget(self.budget_mb, self.budget_ratio, self.budget_ctx)  # validates them
        if self.draft_layers is not None and (self.precision == "auto" or self.budget_mb is not None
                                              or self.budget_ratio is not None):
            raise EllmError("a self-draft (--draft-layers) takes a precision recipe (--quant-level, or --precision "
                            "source), not the measured plan: the analysis measures the whole model")
        if not self.target_names():
            raise EllmError("--target needs at least one preset name or auto")
        if self.numa_nodes is not None and not 1 <= self.numa_nodes <= 64:
            raise EllmError(f"--numa-nodes must be between 1 and 64, got {self.numa_nodes}")
        if self.numa_threads is not None and (self.numa_nodes is None or len(self.numa_threads) not in (1, self.numa_nodes)
                                              or min(self.numa_threads) < 1):
            raise EllmError("--numa-threads takes --numa-nodes N and one thread count >= 1, or N of them (one per node)")
        measured = self.precision == "auto" or (self.precision is None and self.quant_level is None)
        if self.tensor_parallel is not None and (measured or self.draft_layers is not None
                                                 or self.numa_nodes is not None):
            raise EllmError("a tensor-parallel rank takes a precision recipe (--precision source or --quant-level), "
                            "and neither --draft-layers nor --numa-nodes: each rank is one node's slice")

    def target_names(self) -> list[str]:
        return [n.strip() for n in self.target.split(",") if n.strip()]

    def presets(self) -> list[TargetPreset]:
        """The targets, best first (ISA class, then vector width; ties keep the given order), each once."""
        presets: list[TargetPreset] = []
        for n in self.target_names():
            p = resolve_target(n)
            if p not in presets:
                presets.append(p)
        return sorted(presets, key=lambda p: p.rank, reverse=True)

    def for_targets(self) -> TargetOptions:
        return TargetOptions(**{f.name: getattr(self, f.name) for f in fields(TargetOptions)})


@dataclass
class CompileReport:
    path: Path
    seconds: float
    kernels: int
    artifact_bytes: int
    targets: list[str] = field(default_factory=list)
    shared_bytes: int = 0  # parameter bytes every target uses
    timings: dict[str, float] = field(default_factory=dict)
    tuning: list[str] = field(default_factory=list)  # per target: what the tuning database supplied


def _shared_params(builds: list[TargetBuild]) -> tuple[list[ParamSpec], list[list[int]]]:
    """The union of the targets' parameters (first-seen order; equal specs are one array) and, per target,
    the indices of its parameters in kernel order."""
    union: list[ParamSpec] = []
    index: dict[ParamSpec, int] = {}
    per_target = []
    for b in builds:
        ids = []
        for spec in b.lowered.params:
            if spec not in index:
                index[spec] = len(union)
                union.append(spec)
            ids.append(index[spec])
        per_target.append(ids)
    return union, per_target


def _planned_attention(plan) -> AttentionConfig:
    """The artifact's default reads: the plan's top-K where it chose one."""
    d = AttentionConfig()
    return d if plan is None or plan.reads is None or set(plan.reads) == {d.topk} else AttentionConfig(layer_topk=plan.reads)


def compile_model(
    model: str | Path | None,
    out_dir: str | Path,
    options: CompileOptions = CompileOptions(),
    force: bool = False,
    log: Callable[[str], None] = lambda s: None,
) -> CompileReport:
    import tvm

    t_start = time.perf_counter()
    out_dir = Path(out_dir)
    if out_dir.exists() and not force:
        raise EllmError(f"{out_dir} already exists (pass --force to replace it)")
    source = open_model(model, first_layers=options.draft_layers)
    model_path, gf, cfg, tokenizer = source.path, source.gguf, source.config, source.tokenizer
    if options.draft_layers is not None and options.quant_level is None and options.precision is None:
        options = replace(options, quant_level=2)  # a draft is worth only what it saves: everything at 4 bits
    presets = options.presets()
    plan = precision_plan(gf, cfg, options, log=log)
    if plan is not None:
        lowered = sorted({t.name for _, t in plan.weights})
        log(f"precision: {plan.origin}; {len(plan.weights)} weights lowered"
            + (f" (to {', '.join(lowered)})" if lowered else "")
            + (f"; {plan.head_split.describe()}" if plan.head_split is not None else "")
            + ("; the artifact also keeps the embedding's whole table" if plan.head_split and cfg.tied_embeddings else "")
            + "".join(f"; {n}" for n in plan.notes))
    graphs = [build_graph(gf, cfg, options, p, plan) for p in presets]  # import (and validate) before any TVM work
    log(f"model {model_path.name}: {cfg.arch}, {cfg.n_layers} layers, target{'s' if len(presets) > 1 else ''} "
        f"{', '.join(p.name for p in presets)}")

    builds = []
    tuning: list[str] = []
    db = None
    if options.tuning_db is not None:
        from ..autotune import TuningDatabase
        from ..targets import detect_host

        db, host = TuningDatabase.open(options.tuning_db), detect_host()
    for preset, gs in zip(presets, graphs):
        knob_lookup = db.lookup_for(preset.name, host.identity, host.logical_cpus) if db is not None else None
        builds.append(compile_target(gs, options.for_targets(), preset, knob_lookup, log, plan))
        if knob_lookup is not None:
            tuning.append(knob_lookup.summary())
            log(tuning[-1])
    plans = {b.kv_plan.key() for b in builds}
    if len(plans) > 1:
        raise EllmError("the targets plan different KV caches; compile them into separate artifacts")
    union, per_target = _shared_params(builds)

    timings: dict[str, float] = {}
    with atomic_directory(out_dir, replace=force) as tmp:
        t = time.perf_counter()
        for b in builds:
            b.executable.export_library(str(tmp / b.kernels_file))
        timings["link"] = time.perf_counter() - t
        t = time.perf_counter()
        table = write_weights(tmp / WEIGHTS, pack_params(gf, union))  # re-quantises what the plan lowered
        timings["pack_weights"] = time.perf_counter() - t
        (tmp / TOKENIZER).write_text(tokenizer.to_json())
        manifest = {
            "ellm_version": __version__,
            "tvm_version": tvm.__version__,
            "source": {"file": model_path.name, "sha256": gf.sha256(), "bytes": gf.file_size},
            # the model this artifact computes: a tensor-parallel rank's slice of its heads and FFN rows
            "config": (options.tensor_parallel.slice_config(cfg) if options.tensor_parallel else cfg).to_dict(),
            # a self-draft: the source's first `layers` of `of` (speculative/drafters.py); None: the whole model
            "draft": ({"layers": cfg.n_layers, "of": source.file_layers}
                      if options.draft_layers is not None else None),
            "targets": [b.manifest_entry(options.for_targets(), ids) for b, ids in zip(builds, per_target)],
            "kv_cache": builds[0].kv_plan.to_dict(),
            "numa": builds[0].graph.meta("numa"),  # the layout for --numa-nodes N (None: planned at load)
            # this artifact's slice as one rank of a tensor-parallel group (parallel/shard.py; None: the whole model)
            "tensor_parallel": builds[0].graph.meta("tensor_parallel"),
            "precision": (plan.to_dict() if plan is not None else {"origin": "source", "weights": {}}),
            "attention": _planned_attention(plan).to_dict(),  # the read budget it was planned for
            "prefetch": options.prefetch,
            "entries": [{"name": e.name, "tokens": e.m, "logits": "last" if e.last_only else "all",
                         "numerics": "steps" if e.steps or e.m == 1 else "chunks"} for e in ENTRIES],
            "max_verify": MAX_VERIFY,
            "max_chunk": options.max_chunk,
            "params": table,
            "tokenizer": tokenizer.info.to_dict(),
        }
        write_manifest(tmp, manifest, [b.kernels_file for b in builds])
    shared = set.intersection(*(set(ids) for ids in per_target))
    shared_bytes = sum(table[i]["nbytes"] for i in shared)
    if len(builds) > 1:
        total = sum(p["nbytes"] for p in table)
        log(f"weights: {total / 1e6:.1f} MB in one file; {shared_bytes / 1e6:.1f} MB ({len(shared)} of {len(table)} "
            f"arrays) shared by all {len(builds)} targets")
    size = sum(p.stat().st_size for p in out_dir.iterdir())
    return CompileReport(out_dir, time.perf_counter() - t_start, sum(len(b.lowered.kernels) for b in builds), size,
                         [p.name for p in presets], shared_bytes, timings, tuning)
