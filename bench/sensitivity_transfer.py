"""Do the sensitivities predict? Single parts: Spearman correlation between each part's KL measured on the
calibration text and on held-out text, over the most sensitive parts. Whole plans: the planner's predicted KL
(the sum of calibration single-part KLs) against the plan's KL measured whole on held-out text.

    .venv/bin/python bench/sensitivity_transfer.py --out docs/runs/precision-znver4/transfer.json

Held-out text: bench/precision_plans.py's (standard-library docstrings). The first run of each text costs one
analysis (about 4 minutes here); both are cached.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))


def spearman(a: list[float], b: list[float]) -> float:
    ra = np.argsort(np.argsort(a)).astype(float)
    rb = np.argsort(np.argsort(b)).astype(float)
    return float(np.corrcoef(ra, rb)[0, 1])


def main() -> int:
    from precision_plans import heldout_text

    from ellm.compiler.gguf_file import GGUFFile
    from ellm.compiler.import_llama import import_llama
    from ellm.config import ModelConfig
    from ellm.kv.attention import AttentionConfig
    from ellm.models import resolve_model
    from ellm.precision import weight_infos
    from ellm.precision.analysis import load_or_analyse
    from ellm.precision.auto import source_step_bytes, fixed_bytes, measure_plan
    from ellm.precision.calibration import Calibration
    from ellm.precision.planner import KVGeometry, decisions, plan_bytes, solve, to_plan
    from ellm.runtime.tokenizer import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--ratios", default="1.0,0.95,0.9,0.85,0.8423",
                    help="budgets, of the source plan's bytes at 8K (0.8423: 96.0 MB, 85%% of the plain-store rule)")
    a = ap.parse_args()
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731

    gf = GGUFFile(resolve_model(None))
    cfg = ModelConfig.from_gguf(gf)
    tok = Tokenizer.from_gguf(gf)
    infos = weight_infos(import_llama(gf, cfg))
    cal = Calibration.load()
    held = Calibration("stdlib-docstrings", heldout_text())
    t_cal = load_or_analyse(gf, cfg, tok, infos, cal, log=log)
    t_held = load_or_analyse(gf, cfg, tok, infos, held, log=log)

    key = lambda m: (m.part, m.type)  # noqa: E731
    held_kl = {key(m): m.kl for m in t_held.measurements}
    # split heads are left out: each text ranks its own hot rows, so a held-out split is not the calibration's
    # split measured on other text (whole plans below keep the calibration's rows)
    ranked = sorted((m for m in t_cal.measurements if m.kind != "head_split"), key=lambda m: -m.kl)
    top = ranked[: a.top]
    parts = {
        "top": [{"part": m.part, "type": m.type, "kl_calibration": m.kl, "kl_heldout": held_kl[key(m)]} for m in top],
        "spearman_top": spearman([m.kl for m in top], [held_kl[key(m)] for m in top]),
        "spearman_all": spearman([m.kl for m in ranked], [held_kl[key(m)] for m in ranked]),
        "n_all": len(ranked),
    }
    log(f"Spearman over the top {a.top}: {parts['spearman_top']:.3f}; over all {len(ranked)}: {parts['spearman_all']:.3f}")

    kv = KVGeometry(cfg.n_kv_heads, cfg.head_dim)
    attention = AttentionConfig()
    ds = decisions(infos, t_cal, cfg.n_layers, kv, 8192, attention)
    fixed = fixed_bytes(cfg, infos)
    default = source_step_bytes(ds, cfg, kv, 8192, attention) + fixed
    plans = []
    for r in (float(x) for x in a.ratios.split(",")):
        picks = solve(ds, int(r * default) - fixed)
        plan = to_plan(ds, picks, cfg.n_layers, f"auto {r:.0%}")
        t = time.perf_counter()
        on_cal = measure_plan(gf, cfg, tok, plan, t_cal, cal)
        on_held = measure_plan(gf, cfg, tok, plan, t_held, held)
        row = {"ratio": r, "bytes": plan_bytes(ds, picks) + fixed, "predicted_kl": plan.predicted_kl,
               "measured_kl_calibration": on_cal["measured_kl"], "measured_kl_heldout": on_held["measured_kl"],
               "heldout_parts": on_held, "seconds": time.perf_counter() - t}
        plans.append(row)
        log(f"auto {r:.0%}: predicted {plan.predicted_kl:.4f}, measured {on_cal['measured_kl']:.4f} (calibration), "
            f"{on_held['measured_kl']:.4f} (held-out)")
    out = {"parts": parts, "plans": plans, "calibration_seconds": t_cal.seconds, "heldout_seconds": t_held.seconds}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
