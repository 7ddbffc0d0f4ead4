"""Precision plans compared on held-out text: bytes per decoded token, KL against the dense float16 reference,
perplexity, pass-key retrieval and decode speed, for the rule-based default, --quant-level 0/1/2 and the
measured plan (the default compile) at 100% and 85% of the rule-based plan's bytes.

    .venv/bin/python bench/precision_plans.py --out docs/runs/precision-znver4 [--skip-passkey] [--skip-speed]

Held-out text: docstrings of Python standard-library modules (the library reference as the modules carry it),
which every install has; neither the calibration text (the language reference of pydoc_data) nor Newton's
Opticks (`ellm eval`). Every plan is scored against one reference: source weights, float16 KV cache, dense
attention, the target's default activations. Writes results.json and results.md to --out.
"""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
import time
from pathlib import Path

MODULES = ("argparse", "logging", "email.message", "http.client", "json", "collections", "itertools", "functools",
           "subprocess", "threading", "unittest", "pathlib", "datetime", "decimal", "csv", "sqlite3", "asyncio.tasks",
           "typing", "dataclasses", "re", "textwrap", "zipfile", "tarfile", "shutil", "socket", "ssl", "urllib.request",
           "xml.etree.ElementTree", "difflib", "statistics", "random", "heapq", "string", "enum", "contextlib", "abc")


def heldout_text() -> str:
    import importlib

    parts = []
    for name in MODULES:
        mod = importlib.import_module(name)
        parts.append(inspect.getdoc(mod) or "")
        for _, obj in sorted(vars(mod).items()):
            if (inspect.isclass(obj) or inspect.isfunction(obj)) and getattr(obj, "__module__", None) == mod.__name__:
                doc = inspect.getdoc(obj)
                if doc and len(doc) > 200:
                    parts.append(doc)
    return "\n\n".join(p for p in parts if p)


PLANS = {
    "rule plain-store": ["--precision", "source", "--kv-store", "plain"],  # the default before measured plans
    "rule": ["--precision", "source"],  # GGUF types, rule-based KV, protected store
    "quant-level 0": ["--quant-level", "0"],
    "quant-level 1": ["--quant-level", "1"],
    "quant-level 2": ["--quant-level", "2"],
    "auto 100% (default)": [],
    "auto 85%": ["--budget-mb", "{85% of rule plain-store}"],  # the 85%: of the default it was filed against
}


def _ellm(*args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "ellm", *args], capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"ellm {' '.join(args)} failed: {proc.stderr.strip()[-2000:]}")
    return proc.stdout


def _step_bytes(artifact: Path, ctx: int = 8192) -> int:
    """Bytes one decode step reads at ctx: weights plus the KV the artifact's planned reads touch."""
    from ellm.kv.attention import AttentionConfig
    from ellm.kv.plan import KVPlan

    m = json.loads((artifact / "manifest.json").read_text())
    reads = AttentionConfig.from_dict(m.get("attention", {}))
    return m["targets"][0]["decode_weight_bytes"] + KVPlan.from_dict(m["kv_cache"]).read_bytes(ctx, reads)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ctx", default="2048,8192", help="KL and perplexity contexts")
    ap.add_argument("--passkey-lengths", default="2048,8192")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--skip-passkey", action="store_true")
    ap.add_argument("--skip-speed", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plans", default=",".join(PLANS), help=f"comma-separated subset of: {', '.join(PLANS)}")
    ap.add_argument("--activations", default=None,
                    help="compile every plan and the reference with these activations (int16: no 8-bit prefill floor "
                         "in the KLs; quant levels keep their own)")
    a = ap.parse_args()
    out = Path(a.out)
    arts = out / "artifacts"
    arts.mkdir(parents=True, exist_ok=True)

    import numpy as np

    import ellm
    from ellm.compiler.build import CompileOptions, compile_model
    from ellm.eval.passkey import run_passkey
    from ellm.eval.ppl import perplexity
    from ellm.kv.attention import AttentionConfig
    from ellm.kv.plan import KVPlan
    from ellm.models import resolve_model

    chosen = [n.strip() for n in a.plans.split(",") if n.strip()]
    unknown = set(chosen) - set(PLANS)
    if unknown:
        raise SystemExit(f"unknown plans {sorted(unknown)}; known: {', '.join(PLANS)}")
    paths = {}
    if "auto 85%" in chosen and "rule plain-store" not in chosen:
        chosen.insert(0, "rule plain-store")  # its bytes set the 85% budget
    chosen.sort(key=list(PLANS).index)
    for name, flags in ((n, PLANS[n]) for n in chosen):
        if "{85% of rule plain-store}" in flags:
            flags = ["--budget-mb", f"{0.85 * _step_bytes(paths['rule plain-store']) / 1e6:.4f}"]
        p = arts / name.split(" (")[0].replace(" ", "-").replace("%", "")
        if not (p / "manifest.json").is_file():
            t = time.perf_counter()
            act = ["--activations", a.activations] if a.activations and "--quant-level" not in flags else []
            _ellm("compile", "-o", str(p), "--force", *flags, *act)
            print(f"compiled {name} in {time.perf_counter() - t:.0f} s", file=sys.stderr)
        paths[name] = p
    ref_path = arts / "reference"
    if not (ref_path / "manifest.json").is_file():
        compile_model(resolve_model(None), ref_path, CompileOptions(cache_type_k="f16", cache_type_v="f16",
                                                                    activations=a.activations or "auto"), force=True)

    ctxs = [int(c) for c in a.ctx.split(",")]
    text = heldout_text()
    rows: dict[str, dict] = {}
    for name, p in paths.items():
        m = json.loads((p / "manifest.json").read_text())
        plan = KVPlan.from_dict(m["kv_cache"])
        w = m["targets"][0]["decode_weight_bytes"]
        reads = AttentionConfig.from_dict(m.get("attention", {}))  # the read budget the artifact was planned for
        rows[name] = {"artifact": str(p), "precision": m.get("precision", {}), "kv": plan.describe(),
                      "activations": m["targets"][0]["activations"], "attention": reads.describe(),
                      "bytes_8k": _step_bytes(p), "weight_bytes": w}
    for ctx in ctxs:
        ref = ellm.load(ref_path, threads=a.threads, ctx_size=ctx, attention=AttentionConfig.dense())
        ids = ref.tokenizer.encode(text)[:ctx]
        assert len(ids) == ctx, f"held-out text has {len(ids)} tokens, fewer than {ctx}"
        for name, p in paths.items():
            eng = ellm.load(p, threads=a.threads, ctx_size=ctx)
            r = perplexity(eng, ids, ref)
            rows[name][f"kl_{ctx}"] = r.kl_mean
            rows[name][f"ppl_{ctx}"] = r.ppl
            rows[name][f"ref_ppl_{ctx}"] = r.ref_ppl
            print(f"{name:16s} ctx {ctx}: KL {r.kl_mean:.5f} ppl {r.ppl:.4f} (ref {r.ref_ppl:.4f})", file=sys.stderr)
            del eng
    if not a.skip_passkey:
        lengths = [int(x) for x in a.passkey_lengths.split(",")]
        for name, p in paths.items():
            eng = ellm.load(p, threads=a.threads, ctx_size=max(lengths) + 16)
            r = run_passkey(eng, lengths, [0.1, 0.3, 0.5, 0.7, 0.9], a.trials, 0)
            rows[name]["passkey"] = r.to_dict()
            rows[name]["passkey_accuracy"] = float(np.mean([r.length_accuracy(i) for i in range(len(lengths))]))
            print(f"{name:16s} passkey {rows[name]['passkey_accuracy']:.0%}", file=sys.stderr)
            del eng
    if not a.skip_speed:
        names = list(paths)
        rep = json.loads(_ellm("bench", str(paths[names[0]]), "--compare", ",".join(str(paths[n]) for n in names[1:]),
                               "--ctx", "512,8000", "--rounds", "3", "--json"))
        rows["_speed"] = rep
    (out / "results.json").write_text(json.dumps(rows, indent=1))
    print(json.dumps({k: {kk: vv for kk, vv in v.items() if not isinstance(vv, dict)} for k, v in rows.items()
                      if not k.startswith("_")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
