"""`ellm inspect --precision`: the sensitivity table (layers x parts x precisions), a heat map of it, the
chosen plan and its predicted and measured KL."""

from __future__ import annotations

import math

from .analysis import SensitivityTable
from .plan import PrecisionPlan

KIND_ORDER = ("q", "k", "v", "o", "gate", "up", "down", "k_cache", "v_cache", "reads", "activations")


def columns(table: SensitivityTable) -> list[tuple[str, str]]:
    """(kind, type) pairs measured per layer, in a fixed order."""
    seen = {(m.kind, m.type) for m in table.measurements if m.layer is not None}
    return sorted(seen, key=lambda c: (KIND_ORDER.index(c[0]) if c[0] in KIND_ORDER else 99, c[1]))


def grid(table: SensitivityTable) -> tuple[list[tuple[str, str]], list[list[float | None]]]:
    """Columns and the [layer][column] KL (None: not measured)."""
    cols = columns(table)
    n_layers = 1 + max(m.layer for m in table.measurements if m.layer is not None)
    rows: list[list[float | None]] = [[None] * len(cols) for _ in range(n_layers)]
    for m in table.measurements:
        if m.layer is not None:
            rows[m.layer][cols.index((m.kind, m.type))] = m.kl
    return cols, rows


def render_text(table: SensitivityTable, plan: PrecisionPlan | None) -> str:
    cols, rows = grid(table)
    lines = [f"sensitivity of {table.model_sha256[:12]} on {table.calibration} ({len(table.measurements)} parts, "
             f"measured in {table.seconds:.0f} s): mean KL per token, 1e-4 nats, lowering one part alone"]
    head = "layer " + " ".join(f"{k[:6]:>6s}" for k, _ in cols)
    lines += [head, "      " + " ".join(f"{t[:6]:>6s}" for _, t in cols)]
    for i, r in enumerate(rows):
        lines.append(f"{i:5d} " + " ".join("     -" if v is None else f"{v * 1e4:6.1f}" for v in r))
    splits: dict[str, list[str]] = {}
    for m in table.measurements:
        if m.kind == "head":
            lines.append(f"head  {m.part} at {m.type}: {m.kl * 1e4:.1f} (top-1 kept at {m.top1:.1%} of positions)")
        elif m.kind == "head_split":
            cold, n = m.type.split("/")
            splits.setdefault(cold, []).append(f"{n} {m.kl * 1e4:.1f}")
    for cold, cells in splits.items():
        lines.append(f"head  split, likeliest rows kept, the rest at {cold} (hot rows: KL): {', '.join(cells)}")
    top = sorted(table.measurements, key=lambda m: -m.kl)[:10]
    lines.append("most sensitive: " + ", ".join(f"{m.part} {m.type} {m.kl:.2e}" for m in top))
    if plan is not None:
        lines += ["", f"plan: {plan.origin}"]
        weights = plan.weight_types
        by_type: dict[str, list[str]] = {}
        for name, t in weights.items():
            by_type.setdefault(t.name, []).append(name)
        for t, names in sorted(by_type.items()):
            lines.append(f"  {len(names)} weights to {t}: {', '.join(sorted(names)[:6])}{' ...' if len(names) > 6 else ''}")
        if plan.head_split is not None:
            lines.append(f"  {plan.head_split.describe()}")
        if plan.reads is not None:
            from ..kv.attention import AttentionConfig

            lines.append(f"  sparse reads: {AttentionConfig(layer_topk=plan.reads).describe()}")
        if plan.kv_k is not None:
            from ..kv.plan import KVPlan

            desc = KVPlan(1, 32, plan.kv_k, plan.kv_v).describe()
            lines.append(f"  KV cache: {desc}")
        a = plan.summary
        if "measured_kl" in a:
            lines.append(f"  predicted KL {a['predicted_kl']:.4f}, measured {a['measured_kl']:.4f} nats per token "
                         f"(weights {a['measured_kl_weights']:.4f}, KV and reads "
                         f"{a['measured_kl_kv']:.4f})")
        if "plan_bytes" in a:
            lines.append(f"  {a['plan_bytes'] / 1e6:.2f} MB per token at {a['budget_ctx']} (budget {a['budget_bytes'] / 1e6:.2f}, "
                         f"source plan {a['source_bytes'] / 1e6:.2f})")
        lines += [f"  note: {n}" for n in plan.notes]
    return "\n".join(lines)


def plot(table: SensitivityTable, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    cols, rows = grid(table)
    data = np.array([[math.log10(v) if v else np.nan for v in r] for r in rows])
    fig, ax = plt.subplots(figsize=(1.0 + 0.6 * len(cols), 0.25 * len(rows) + 2))
    im = ax.imshow(data, aspect="auto", cmap="magma_r")
    ax.set_xticks(range(len(cols)), [f"{k}\n{t}" for k, t in cols], fontsize=7)
    ax.set_ylabel("layer")
    heads = [m for m in table.measurements if m.kind == "head"]
    title = "log10 KL (nats/token) of lowering one part" + (
        "; head: " + ", ".join(f"{m.type} {m.kl:.3f}" for m in heads) if heads else "")
    ax.set_title(title, fontsize=9)
    fig.colorbar(im, ax=ax, shrink=0.8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def inspect_precision(model, options, plot_path: str | None = None, as_json: bool = False,
                      log=lambda s: None) -> str:
    """The sensitivity table of `model` (measured once, then cached), the plan `options` ask for (auto, at
    their budget), its check, and optionally the heat map."""
    import json
    from dataclasses import replace

    from ..compiler.compile_target import precision_plan
    from ..compiler.source_model import open_model
    from .analysis import load_or_analyse
    from .calibration import Calibration
    from .plan import weight_infos

    source = open_model(model)
    gf, cfg, g0 = source.gguf, source.config, source.graph
    options = replace(options, precision="auto") if options.quant_level is None else options
    plan = precision_plan(gf, cfg, options, g0, log=log)
    table = load_or_analyse(gf, cfg, source.tokenizer, weight_infos(g0), Calibration.load(options.calibration), log=log)
    if plot_path:
        plot(table, plot_path)
    if as_json:
        return json.dumps({"sensitivity": table.to_dict(), "plan": plan.to_dict() if plan else None}, indent=1)
    return render_text(table, plan)
