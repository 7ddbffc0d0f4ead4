"""`ellm eval passkey|ppl`: run an evaluation on an artifact, optionally against the dense F16-KV reference."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cli import _positive_int, add_attention_args, add_rope_scaling_args, attention_option, prefill_progress, rope_scaling_option
from ..errors import EllmError


def _floats(s: str) -> list[float]:
    try:
        vals = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None
    if not vals:
        raise argparse.ArgumentTypeError("expected at least one number")
    return vals


def _ints(s: str) -> list[int]:
    vals = _floats(s)
    if any(v != int(v) or v < 2 for v in vals):
        raise argparse.ArgumentTypeError(f"expected comma-separated token counts >= 2, got {s!r}")
    return [int(v) for v in vals]


def add_parser(sub) -> None:
    e = sub.add_parser("eval", help="long-context evaluations: pass-key retrieval, perplexity and KL")
    esub = e.add_subparsers(dest="eval_cmd", required=True)

    def common(p) -> None:
        p.add_argument("--model", help="the GGUF the artifact was compiled from (for --against; default: the bundled model)")
        p.add_argument("--against", choices=["dense"], help="also run the dense F16-KV reference and compare")
        p.add_argument("--threads", type=_positive_int, default=None)
        p.add_argument("--json", action="store_true", help="print one JSON object")
        add_rope_scaling_args(p)
        add_attention_args(p)

    p = esub.add_parser("passkey", help="find a pass key hidden at several depths of long filler text")
    p.add_argument("artifact", nargs="?", help="artifact directory (default: the bundled model, compiled and cached)")
    p.add_argument("--lengths", type=_ints, default=[1024, 2048, 4096, 8192], help="prompt lengths in tokens")
    p.add_argument("--depths", type=_floats, default=[0.1, 0.3, 0.5, 0.7, 0.9], help="key positions in [0, 1]")
    p.add_argument("--trials", type=_positive_int, default=1, help="random keys per length and depth")
    p.add_argument("--seed", type=int, default=0)
    common(p)

    q = esub.add_parser("ppl", help="perplexity of a long text (and KL divergence from the reference)")
    q.add_argument("artifact", nargs="?", help="artifact directory (default: the bundled model, compiled and cached)")
    q.add_argument("file", help="text file")
    q.add_argument("--ctx", type=int, default=2048, help="tokens scored from the start of the text")
    common(q)


def _log(s: str) -> None:
    print(s, file=sys.stderr, flush=True)


def _engines(a: argparse.Namespace, ctx: int):
    """(engine, reference engine or None, description of both)."""
    from ..demo import cached_artifact
    from ..kv.attention import AttentionConfig
    from ..runtime.engine import Engine
    from .reference import reference_artifact

    path = Path(a.artifact) if a.artifact else cached_artifact(log=_log)
    rope = rope_scaling_option(a)
    eng = Engine.load(path, threads=a.threads, ctx_size=ctx, rope_scaling=rope, attention=attention_option(a, path))
    ref = None
    if a.against:
        ref_path = reference_artifact(path, a.model, log=_log)
        ref = Engine.load(ref_path, threads=a.threads, ctx_size=ctx, rope_scaling=rope, attention=AttentionConfig.dense())
    return eng, ref


def cmd_eval(a: argparse.Namespace) -> int:
    if a.eval_cmd == "passkey":
        return _passkey(a)
    return _ppl(a)


def _passkey(a: argparse.Namespace) -> int:
    from .passkey import run_passkey

    if any(not 0 <= d <= 1 for d in a.depths):
        raise EllmError("--depths must lie in [0, 1]")
    ctx = max(a.lengths) + 16
    eng, ref = _engines(a, ctx)

    def progress(r: dict) -> None:
        if not a.json:
            mark = "found" if r["correct"] else f"missed ({r['answer'].strip()!r})"
            _log(f"  length {r['length']:>6} depth {r['depth']:.2f}: {mark}")

    runs = {"this": eng} | ({"dense": ref} if ref is not None else {})
    results = {}
    for name, e in runs.items():
        _log(f"pass key: {name} ({e.artifact.path.name}, {describe(e)})")
        results[name] = run_passkey(e, a.lengths, a.depths, a.trials, a.seed, progress)
    if a.json:
        print(json.dumps({name: {"config": describe(runs[name]), **r.to_dict()} for name, r in results.items()}))
        return 0
    for name, r in results.items():
        print(f"\npass-key accuracy, {name}: {describe(runs[name])} ({r.trials} trial(s) per cell)")
        print(f"{'length':>8} " + " ".join(f"{d:>6.2f}" for d in r.depths) + "    all")
        for i, n in enumerate(r.lengths):
            cells = " ".join(f"{r.accuracy(i, j):>6.0%}" for j in range(len(r.depths)))
            print(f"{n:>8} {cells} {r.length_accuracy(i):>6.0%}")
    return 0


def _ppl(a: argparse.Namespace) -> int:
    from .ppl import perplexity

    try:
        text = Path(a.file).read_text(errors="replace")
    except OSError as e:
        raise EllmError(f"cannot read {a.file}: {e.strerror}") from None
    if a.ctx < 2:
        raise EllmError("--ctx must be at least 2")
    eng, ref = _engines(a, a.ctx)
    ids = eng.tokenizer.encode(text)[: a.ctx]
    if len(ids) < a.ctx:
        raise EllmError(f"{a.file} has only {len(ids)} tokens; --ctx {a.ctx} needs more text")

    r = perplexity(eng, ids, ref, progress=None if a.json else prefill_progress())
    out = {"file": str(a.file), "ctx": a.ctx, "config": describe(eng), **r.to_dict()}
    if ref is not None:
        out["reference_config"] = describe(ref)
    if a.json:
        print(json.dumps(out))
        return 0
    print(f"{a.file}: {r.tokens:,d} tokens scored, {describe(eng)}")
    print(f"  perplexity {r.ppl:.4f}")
    if ref is not None:
        rel = r.ppl / r.ref_ppl - 1
        print(f"  reference ({describe(ref)}): perplexity {r.ref_ppl:.4f}  (this is {rel:+.2%})")
        print(f"  KL(reference || this): mean {r.kl_mean:.5f} nats, max {r.kl_max:.4f}; top-1 agreement {r.top1_agree:.2%}")
    return 0


def describe(eng) -> str:
    """The settings that change results: attention mode and KV precision."""
    rs = eng.config.rope_scaling
    rope = f", RoPE {rs.kind} x{rs.factor:g}" if rs.kind != "none" else ""
    return f"{eng.attention.describe()}, {eng.kv_plan.describe()}{rope}"
