"""`--precision auto`: measure (or reuse) the model's sensitivities, plan under the byte budget, then measure
the chosen plan as a whole to check the planner's additivity assumption."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Callable

import numpy as np

from ..compiler.gguf_file import GGUFFile
from ..config import ModelConfig
from ..kv.attention import AttentionConfig
from ..kv.plan import KVPlan, KVType
from .analysis import AnalysisSettings, SensitivityTable, load_or_analyse
from .calibration import Calibration
from .divergence import Reference
from .kv_read import BlockReader
from .model import FloatModel, LayerEdit, lowered_values
from .plan import Budget, PrecisionPlan, WeightInfo
from .planner import Decision, KVGeometry, decisions, plan_bytes, solve, to_plan
from .sparse_read import SparseSelect


def fixed_bytes(cfg: ModelConfig, infos: list[WeightInfo]) -> int:
    """What a step reads besides the planned weights and KV: one embedding row and the norm vectors."""
    embd = next(i for i in infos if i.part == "head") if cfg.tied_embeddings else None
    row = embd.nbytes(embd.source) // embd.rows if embd is not None else 0
    return row + 4 * cfg.d_model * (2 * cfg.n_layers + 1)


def source_step_bytes(ds: list[Decision], cfg: ModelConfig, kv: KVGeometry, ctx: int, attention: AttentionConfig,
                       fixed_kv: tuple[KVType | None, KVType | None] = (None, None)) -> int:
    """Bytes per token of the source-precision compile with these options: every weight at its source type, the
    rule-based KV plan (`fixed_kv`: the cache types the user gave, which replace the rule's on their side)."""
    rule = KVPlan.auto(cfg.n_layers, kv.n_kv_heads, kv.head_dim, kv.max_chunk, *fixed_kv, kv.block, kv.recent,
                       pinned=kv.pinned, rotate_k=kv.rotate_k)
    weights = sum(d.choices[0].bytes for d in ds if d.kind == "weights")
    return weights + rule.read_bytes(ctx, attention)


def auto_plan(gf: GGUFFile, cfg: ModelConfig, tokenizer, infos: list[WeightInfo], budget: Budget, kv: KVGeometry,
              calibration: Calibration, settings: AnalysisSettings | None = None,
              log: Callable[[str], None] = lambda s: None, check: bool = True,
              fixed_kv: tuple[KVType | None, KVType | None] = (None, None)) -> PrecisionPlan:
    """`fixed_kv`: K and V cache types the user chose (None: planned). `settings`: the analysis's (default: its
    defaults, with the KV store of `kv`)."""
    settings = settings or AnalysisSettings(block=kv.block, recent=kv.recent, pinned=kv.pinned, rotate_k=kv.rotate_k)
    table = load_or_analyse(gf, cfg, tokenizer, infos, calibration, settings, log)
    attention = AttentionConfig()
    ds = decisions(infos, table, cfg.n_layers, kv, budget.ctx, attention, *fixed_kv)
    fixed = fixed_bytes(cfg, infos)
    source = source_step_bytes(ds, cfg, kv, budget.ctx, attention, fixed_kv) + fixed
    limit = budget.bytes(source)
    picks = solve(ds, limit - fixed)
    chosen = plan_bytes(ds, picks) + fixed
    origin = f"auto: {limit / 1e6:.2f} MB per token at {budget.ctx} ({limit / source:.0%} of the source plan's)"
    plan = to_plan(ds, picks, cfg.n_layers, origin,
                   ("candidates never exceed a tensor's source type: bytes are only ever saved, never spent raising",),
                   attention.topk)
    summary = {"model_sha256": table.model_sha256, "calibration": table.calibration,
               "calibration_sha256": table.calibration_sha256, "analysis_seconds": round(table.seconds, 1),
               "measurements": len(table.measurements), "budget_ctx": budget.ctx, "budget_bytes": limit,
               "source_bytes": source, "plan_bytes": chosen,
               "predicted_kl_weights": sum(d.choices[i].kl for d, i in zip(ds, picks) if d.kind == "weights")}
    if check:
        measured = checked_plan(gf, cfg, tokenizer, plan, table, calibration, log)
        summary.update(measured)
        log(f"precision plan: predicted KL {plan.predicted_kl:.4f}, measured {measured['measured_kl']:.4f} "
            f"(weights {measured['measured_kl_weights']:.4f}, KV and reads "
            f"{measured['measured_kl_kv']:.4f}) nats per token")
    reads = "" if plan.reads is None else f", {AttentionConfig(layer_topk=plan.reads).describe()}"
    log(f"precision plan: {chosen / 1e6:.2f} MB per token at {budget.ctx} (budget {limit / 1e6:.2f}, source plan "
        f"{source / 1e6:.2f}){reads}")
    return replace(plan, summary=summary)


def checked_plan(gf: GGUFFile, cfg: ModelConfig, tokenizer, plan: PrecisionPlan, table: SensitivityTable,
                 calibration: Calibration, log: Callable[[str], None] = lambda s: None) -> dict:
    """measure_plan's result, cached beside the sensitivity table by the plan's choices (a recompile with the
    same plan does not measure it again)."""
    import hashlib
    import json

    from ..fsutil import atomic_write_text
    from .analysis import cache_path

    choices = json.dumps({k: plan.to_dict().get(k) for k in ("weights", "kv_k", "kv_v", "head_split", "reads")}, sort_keys=True)
    table_path = cache_path(table.model_sha256, table.calibration_sha256, table.settings)
    path = table_path.with_name(f"{table_path.stem}-plan-{hashlib.sha256(choices.encode()).hexdigest()[:16]}.json")
    if path.is_file():
        try:
            return json.loads(path.read_text())
        except ValueError:
            pass
    t = time.perf_counter()
    measured = measure_plan(gf, cfg, tokenizer, plan, table, calibration)
    measured["check_seconds"] = round(time.perf_counter() - t, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(measured))
    return measured


def measure_plan(gf: GGUFFile, cfg: ModelConfig, tokenizer, plan: PrecisionPlan, table: SensitivityTable,
                 calibration: Calibration) -> dict:
    """The whole plan's KL on the float model, all parts lowered at once, split as the parts were measured:
    weights and head on the short calibration sequences, K and V caches at long context."""
    s = table.settings
    ids = np.asarray(calibration.tokens(tokenizer, s.tokens + s.kv_ctx))
    model = FloatModel(gf, cfg, max_ctx=max(s.kv_ctx, s.seq))
    lowered = {name: lowered_values(gf, name, t) for name, t in plan.weights}
    edits: dict[int, LayerEdit] = {}
    for name, w in lowered.items():
        if name.startswith("blk."):
            layer = int(name.split(".")[1])
            edits.setdefault(layer, LayerEdit(weights={})).weights[name] = w
    head = lowered.get(model.head_name)
    if plan.head_split is not None:  # hot rows at the head's planned type, the others at the cold type
        cold = np.asarray(plan.head_split.cold_ids(cfg.vocab_size))
        head = (model.w[model.head_name] if head is None else head).copy()
        head[cold] = lowered_values(gf, model.head_name, plan.head_split.cold)[cold]
    kls = []
    for seq in ids[: s.tokens].reshape(-1, s.seq):
        x0 = model.embed(seq)
        ref = Reference(model.logits(model.rerun(0, x0, 0, {})[:: s.stride]))
        h = model.head_input(model.rerun(0, x0, 0, edits)[:: s.stride])
        kls.append(ref.kl(h @ (head if head is not None else model.w[model.head_name]).T))
    kl_w = float(np.concatenate(kls).mean())
    # a layer reading fewer blocks than the default is measured reading them (its parts were: against dense)
    default = AttentionConfig().topk
    reads = plan.reads or (default,) * cfg.n_layers
    kv_edits = {i: LayerEdit(read_k=BlockReader("k", kt, s.block, s.recent, s.pinned, s.rotate_k),
                             read_v=BlockReader("v", vt, s.block, s.recent, s.pinned),
                             select=None if r >= default else SparseSelect(AttentionConfig(topk=r), s.block, s.recent,
                                                                           s.rotate_k and not kt.is_float))
                for i, (kt, vt, r) in enumerate(zip(plan.kv_k, plan.kv_v, reads))
                if r < default or not (kt.is_float and vt.is_float)}
    kl_kv = 0.0
    if kv_edits:
        kv_ids = ids[s.tokens : s.tokens + s.kv_ctx]
        P = s.kv_ctx - s.kv_scored
        xs, kvs = model.run(kv_ids, keep_kv=True, keep_from=P)
        past = [(k[:P], v[:P]) for k, v in kvs]
        ref = Reference(model.logits(xs[-1]))
        kl_kv = float(ref.kl(model.logits(model.rerun(0, xs[0], P, kv_edits, past, chunk=s.block))).mean())
    return {"predicted_kl": plan.predicted_kl, "measured_kl": kl_w + kl_kv, "measured_kl_weights": kl_w,
            "measured_kl_kv": kl_kv}
