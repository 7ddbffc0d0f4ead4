"""`ellm inspect`: what a model's graph is made of, before and after the passes, and what a step reads."""

from __future__ import annotations

import json
from collections import defaultdict

from .graph import Graph, OpKind
from .source_model import open_model


def weight_bytes_by_type(g: Graph) -> dict[str, dict[str, int]]:
    """Per format: tensors, elements and bytes of the graph's weights and vectors (each counted once)."""
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"tensors": 0, "elements": 0, "bytes": 0})
    for w in g.weights():
        e = out[w.qtype.name]
        e["tensors"] += len(w.sources)
        e["elements"] += w.rows * w.cols
        e["bytes"] += w.nbytes
    for v in g.vector_params():
        e = out["F32 vectors"]
        e["tensors"] += len(v.sources)
        e["elements"] += v.size
        e["bytes"] += 4 * v.size
    return dict(out)


def decode_weight_bytes(g: Graph) -> int:
    """Weight bytes a one-token step reads: every matmul weight once, one embedding row, all vectors."""
    total = 0
    seen = set()
    for _, op in g.nodes():
        if op.kind is not OpKind.EMBEDDING:
            for w in op.weights:
                if w.name not in seen:
                    seen.add(w.name)
                    total += w.nbytes
        else:
            total += op.weight.nbytes // op.weight.rows
    return total + sum(4 * v.size for v in g.vector_params())


def inspect_model(model, cache_type_k: str = "auto", cache_type_v: str = "auto", as_json: bool = False,
                  kv_store: str = "protected") -> str:
    source = open_model(model)  # a bad file is refused before TVM is imported (the passes import it)
    from ..kv.plan import KVPlan, parse_kv_type
    from ..targets import resolve_target
    from .compile_target import kv_store_fields
    from .pass_context import KVOptions, PassContext
    from .pipeline import enabled_passes, run_pipeline

    path, cfg, g0 = source.path, source.config, source.graph
    pinned, rotate_k = kv_store_fields(kv_store)
    kv_opts = KVOptions(parse_kv_type(cache_type_k), parse_kv_type(cache_type_v), pinned=pinned, rotate_k=rotate_k)
    g = run_pipeline(g0, PassContext(resolve_target("auto"), kv=kv_opts))
    plan = KVPlan.from_key(g.op("kv_cache").attr("kv_plan"))
    kv_desc = f"{plan.describe()}, blocks of {plan.block}"
    info = {
        "model": path.name,
        "config": cfg.to_dict(),
        "ops_imported": dict(g0.op_counts()),
        "ops": dict(g.op_counts()),
        "passes": enabled_passes(),
        "weights": weight_bytes_by_type(g),
        "decode_weight_bytes_per_token": decode_weight_bytes(g),
        "kv_cache": kv_desc,
        "kv_bytes_per_token": plan.bytes_per_token(),
        "kv_bytes_per_token_f16": cfg.kv_bytes_per_token(2),
    }
    if as_json:
        return json.dumps(info, indent=1)
    lines = [
        f"model   {path.name}: {cfg.arch}, {cfg.n_layers} layers, d_model {cfg.d_model}, "
        f"{cfg.n_heads} heads / {cfg.n_kv_heads} KV heads of {cfg.head_dim}, FFN {cfg.d_ff}, vocab {cfg.vocab_size}, "
        f"context {cfg.ctx_train}",
        f"passes  {', '.join(enabled_passes())}",
        "ops     imported -> compiled",
    ]
    kinds = sorted(set(info["ops_imported"]) | set(info["ops"]))
    for k in kinds:
        lines.append(f"  {k:16s} {info['ops_imported'].get(k, 0):5d} -> {info['ops'].get(k, 0):5d}")
    lines.append("weights  type          tensors      elements        bytes")
    total = 0
    for t, e in sorted(info["weights"].items()):
        total += e["bytes"]
        lines.append(f"  {t:16s} {e['tensors']:9d} {e['elements']:13,d} {e['bytes']:12,d}")
    lines.append(f"  {'total':16s} {'':9s} {'':13s} {total:12,d}")
    lines.append(f"decode  weight bytes read per token: {info['decode_weight_bytes_per_token']:,d}")
    kvb = info["kv_bytes_per_token"]
    lines.append(
        f"KV      {kv_desc}: {kvb:,.0f} bytes per token ({100 * kvb / info['kv_bytes_per_token_f16']:.1f}% of float16; "
        f"{plan.nbytes(512) / 1e6:.1f} MB at 512, {plan.nbytes(cfg.ctx_train) / 1e6:.1f} MB at {cfg.ctx_train} tokens)"
    )
    return "\n".join(lines)
