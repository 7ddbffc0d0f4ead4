"""One target of an artifact: the graph through the passes for that target, lowered, compiled by TVM."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

from ..config import ModelConfig
from ..errors import EllmError
from ..kv.plan import KVPlan, parse_kv_type
from ..numa.topology import allowed_cpus, read_topology
from ..parallel.shard import TensorParallel
from ..precision import Budget, PrecisionPlan, quant_level_plan, weight_infos
from ..targets import TargetPreset
from .gguf_file import GGUFFile
from .graph import Graph
from .import_llama import import_llama
from .inspect import decode_weight_bytes
from ..schedules.attention import default_int_bits
from .lower import MAX_VERIFY, Lowered, lower
from .pass_context import ACTIVATIONS, KVOptions, PassContext, auto_activations
from .pipeline import enabled_passes, run_pipeline
from .tir_pipeline import compile_tir


@dataclass(frozen=True)
class TargetOptions:
    """What compile options every target shares (CompileOptions holds these plus the targets)."""

    cache_type_k: str = "auto"
    cache_type_v: str = "auto"
    kv_block: int = 64
    kv_recent: int = 2
    # "protected": quantised keys stored Hadamard-rotated and the first block (the attention sinks) kept in the
    # float16 ring; "plain": neither (kv/plan.py)
    kv_store: str = "protected"
    disable_passes: tuple[str, ...] = ()
    enable_passes: tuple[str, ...] = ()
    max_chunk: int = 256
    activations: str = "auto"
    prefetch: bool = True
    quant_level: int | None = None  # --quant-level 0/1/2 (precision/levels.py); None: the GGUF's types
    # "auto": the measured plan under the byte budget (precision/auto.py); "source": the GGUF's types and the
    # rule-based KV plan; None: auto, unless a quant level is given
    precision: str | None = None
    budget_mb: float | None = None  # bytes read per decoded token at budget_ctx, in 10^6 bytes ...
    budget_ratio: float | None = None  # ... or as a share of today's default (source weights, rule-based KV)
    budget_ctx: int = 8192
    calibration: str | None = None  # calibration text file (default: Python's language reference)
    # a self-draft for speculative decoding: only the first `draft_layers` layers, then the output norm and head
    # (speculative/drafters.py); None: the whole model
    draft_layers: int | None = None
    # plan the NUMA layout for this many nodes and record it in the manifest (None: planned at load)
    numa_nodes: int | None = None
    # threads per node the kernels split their work for: one count for every node, or one per node (None: this
    # machine's physical cores shared evenly, at least one)
    numa_threads: tuple[int, ...] | None = None
    # compile one rank's slice of the model (parallel/shard.py; `ellm compile --tp N` compiles every rank)
    tensor_parallel: TensorParallel | None = None


KV_STORES = ("protected", "plain")


def kv_store_fields(kv_store: str) -> tuple[int, bool]:
    """--kv-store -> (pinned blocks, rotated keys)."""
    if kv_store not in KV_STORES:
        raise EllmError(f"--kv-store must be one of {', '.join(KV_STORES)}, got {kv_store!r}")
    return (1, True) if kv_store == "protected" else (0, False)


def precision_plan(gf: GGUFFile, cfg: ModelConfig, options: TargetOptions, g0: Graph | None = None,
                   log: Callable[[str], None] = lambda s: None, check: bool = True) -> PrecisionPlan | None:
    """The precision plan `options` ask for (None: every weight at its source type, KV as the options say).
    `--precision auto` (the default) measures the model once (cached by its sha256 and the calibration text);
    `check` then measures the chosen plan as a whole. With both cache types given and no budget, the budget is
    the source weights plus those caches: the source plan is the only one of zero KL, so nothing is measured."""
    fixed = (parse_kv_type(options.cache_type_k), parse_kv_type(options.cache_type_v))
    if options.quant_level is None and options.precision == "source":
        return None
    explicit_budget = options.budget_mb is not None or options.budget_ratio is not None
    if options.quant_level is None and None not in fixed and not explicit_budget:
        log("precision: source types (both cache types given: nothing to plan at the default's bytes)")
        return None
    if options.quant_level is None:
        from ..precision.model import analysis_memory, available_memory

        need, have = analysis_memory(cfg), available_memory()
        if need > 0.8 * have:
            msg = (f"the sensitivity analysis of this model needs about {need / 2**30:.1f} GiB of memory and "
                   f"{have / 2**30:.1f} GiB is available")
            if options.precision == "auto":  # asked for by name: say so
                raise EllmError(f"{msg}; compile with --precision source or --quant-level 0|1|2")
            log(f"precision: source types ({msg}; --quant-level 0|1|2 lowers by recipe)")
            return None
    g0 = g0 if g0 is not None else import_llama(gf, cfg)
    infos = weight_infos(g0)
    if options.quant_level is not None:
        plan = quant_level_plan(options.quant_level, infos, cfg.n_layers)
    else:
        from ..precision.auto import auto_plan
        from ..precision.calibration import Calibration
        from ..precision.planner import KVGeometry
        from ..runtime.tokenizer import Tokenizer

        budget = Budget(options.budget_mb, options.budget_ratio, options.budget_ctx)
        kv = KVGeometry(cfg.n_kv_heads, cfg.head_dim, options.kv_block, options.kv_recent, step_tokens(options),
                        *kv_store_fields(options.kv_store))
        plan = auto_plan(gf, cfg, Tokenizer.from_gguf(gf), infos, budget, kv, Calibration.load(options.calibration),
                         log=log, check=check, fixed_kv=fixed)
    plan.check(infos, cfg.n_layers)
    return plan


def step_tokens(options: TargetOptions) -> int:
    """The most tokens one step writes to the KV cache (it sizes the float16 ring): a prefill chunk or a
    verification step."""
    return max(options.max_chunk, MAX_VERIFY)


def pass_context(options: TargetOptions, preset: TargetPreset, plan: PrecisionPlan | None = None) -> PassContext:
    activations = chunks = options.activations
    attention_bits = None
    if activations == "auto" and plan is not None and plan.activations is not None and preset.isa is not None:
        activations = chunks = plan.activations
    elif activations == "auto":
        activations, chunks = auto_activations(preset)
        attention_bits = default_int_bits(preset)  # 8-bit matmul activations keep attention's own default
    elif activations != "f32" and preset.isa is None:
        raise EllmError(f"{activations} activations need integer dot products (AVX2 or later), which target {preset.name} lacks")
    assert activations in ACTIVATIONS
    kv = KVOptions(parse_kv_type(options.cache_type_k), parse_kv_type(options.cache_type_v), options.kv_block,
                   options.kv_recent, step_tokens(options), *kv_store_fields(options.kv_store))
    return PassContext(preset, activations, chunks, kv, plan, attention_bits, options.numa_nodes,
                       numa_threads(options), options.tensor_parallel)


def numa_threads(options: TargetOptions) -> tuple[int, ...] | None:
    """Threads per node for --numa-nodes N: as stated, or this machine's physical cores shared evenly."""
    n = options.numa_nodes
    if n is None:
        return None
    if options.numa_threads is not None:
        t = options.numa_threads
        return tuple(t) * n if len(t) == 1 else tuple(t)
    cores = len(read_topology().physical_cores(allowed_cpus(), None))
    return (max(1, cores // n),) * n


def build_graph(gf: GGUFFile, cfg: ModelConfig, options: TargetOptions, preset: TargetPreset,
                plan: PrecisionPlan | None = None) -> tuple[Graph, Graph]:
    """(imported graph, optimised graph). `plan`: the precision plan (default: the one `options` ask for)."""
    g0 = import_llama(gf, cfg)
    if plan is None:
        plan = precision_plan(gf, cfg, options, g0)
    ctx = pass_context(options, preset, plan)
    return g0, run_pipeline(g0, ctx, disable=options.disable_passes, enable=options.enable_passes)


@dataclass
class TargetBuild:
    preset: TargetPreset
    activations: dict[str, str]  # precision of one-token steps and of chunks
    graph0: Graph
    graph: Graph
    lowered: Lowered
    executable: Any  # tvm.runtime.Executable
    timings: dict[str, float] = field(default_factory=dict)

    @property
    def kv_plan(self) -> KVPlan:
        return KVPlan.from_key(self.graph.op("kv_cache").attr("kv_plan"))

    @property
    def kernels_file(self) -> str:
        return f"kernels-{self.preset.name}.so"

    def manifest_entry(self, options: TargetOptions, param_indices: list[int]) -> dict[str, Any]:
        """This target's part of the manifest; `param_indices` point into the artifact's shared parameter table."""
        p = self.preset
        return {
            "preset": p.name,
            "isa": p.isa.label if p.isa is not None else None,
            "tvm": p.target_json(),
            "required_cpu_features": p.required_cpu_features,
            "kernels_file": self.kernels_file,
            "activations": self.activations,  # {"steps": ..., "chunks": ..., "attention_bits": ...}
            "decode_weight_bytes": decode_weight_bytes(self.graph),
            "graph": {
                "passes": enabled_passes(options.disable_passes, options.enable_passes),
                "ops_imported": dict(self.graph0.op_counts()),
                "ops": dict(self.graph.op_counts()),
            },
            "kernels": [{"name": k.name, "rule": k.rule, "knobs": k.knobs, "request": k.request}
                        | ({"numa_tasks": k.numa_tasks} if k.numa_tasks else {}) for k in self.lowered.kernels],
            "params": param_indices,
        }


def compile_target(graphs: tuple[Graph, Graph], options: TargetOptions, preset: TargetPreset, knob_lookup=None,
                   log: Callable[[str], None] = lambda s: None, plan: PrecisionPlan | None = None) -> TargetBuild:
    """`graphs`: build_graph's (imported, optimised) graphs for this target."""
    from tvm import relax

    timings = {}
    g0, g = graphs
    t = time.perf_counter()
    lowered = lower(g, preset, knob_lookup, max_chunk=options.max_chunk, prefetch=options.prefetch)
    timings["lower"] = time.perf_counter() - t
    t = time.perf_counter()
    executable = compile_tir(lowered.mod, preset, relax_pipeline=relax.pipeline.default_build_pipeline())
    timings["tvm_compile"] = time.perf_counter() - t
    log(f"target {preset.name} ({preset.isa.label if preset.isa else 'float'}): "
        f"compiled {len(lowered.kernels)} kernels in {timings['tvm_compile']:.1f}s")
    ctx = pass_context(options, preset, plan)
    activations = {"steps": ctx.activations, "chunks": ctx.chunk_activations,
                   "attention_bits": str(ctx.attention_bits or (8 if ctx.activations == "int8" else 16))}
    return TargetBuild(preset, activations, g0, g, lowered, executable, timings)
