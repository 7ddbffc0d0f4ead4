"""`ellm bench --spec`: effective decode speed with and without speculation on the task set
(bench/spec_tasks.py), eLLM and optionally llama.cpp (without speculation and with its prompt lookup), each
system in its own process, each task's two modes alternating within it."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import EllmError
from ..targets import detect_host
from .runner import run_worker


@dataclass(frozen=True)
class SpecBenchConfig:
    artifact: Path
    model: Path
    ctxs: tuple[int, ...] = (2048, 8000)
    gen: int = 256
    chain: int = 16
    drafters: tuple[str, ...] = ("ngram",)
    draft_model: Path | None = None
    rounds: int = 2
    threads: int = 2
    tasks: str | None = None  # comma-separated names (default: all)
    llama_build: str | None = None  # "native", "avx512", "avx2": also run llama.cpp
    llama_kv: str = "f16"
    llama_flash: bool = True

    def __post_init__(self) -> None:
        if not self.ctxs or min(self.ctxs) < 256:
            raise EllmError("--spec needs prompt lengths of at least 256 tokens")
        if not 1 <= self.chain <= 31:
            raise EllmError(f"--chain must be between 1 and 31, got {self.chain}")
        from ..speculative.config import DRAFTERS

        bad = [d for d in self.drafters if d not in DRAFTERS]
        if bad or not self.drafters or len(set(self.drafters)) < len(self.drafters):
            raise EllmError(f"--draft takes drafters out of {', '.join(DRAFTERS)}, each once; got {','.join(self.drafters)}")
        if (set(self.drafters) - {"ngram"}) and self.draft_model is None:
            raise EllmError("--draft model or cascade needs --draft-model DIR|GGUF")


def _summaries(system: str, ctx: int, row: dict) -> list[dict]:
    """One row per drafter: medians over rounds against the plain runs', acceptance summed over rounds."""
    plain = row["runs"]["plain"]
    p = float(np.median([r["tok_s"] for r in plain]))
    out = []
    for draft, spec in row["runs"].items():
        if draft == "plain":
            continue
        s = float(np.median([r["tok_s"] for r in spec]))
        r = {"system": system, "draft": draft, "ctx": ctx, "task": row["task"], "grounded": row["grounded"],
             "prompt_tokens": row["prompt_tokens"], "tokens": spec[-1]["tokens"], "plain_tok_s": p, "spec_tok_s": s,
             "speedup": s / p, "identical": row["identical"][draft]}
        if "drafted" in spec[0]:
            drafted, accepted = sum(x["drafted"] for x in spec), sum(x["accepted"] for x in spec)
            verify = sum(x["verify_steps"] for x in spec)
            r.update(accept_rate=accepted / drafted if drafted else None,
                     mean_accepted=accepted / verify if verify else None,
                     verify_steps=verify / len(spec), decode_steps=sum(x["decode_steps"] for x in spec) / len(spec),
                     draft_s=float(np.median([x["draft_s"] for x in spec])))
        out.append(r)
    return out


def run_spec_bench(cfg: SpecBenchConfig, log: Callable[[str], None] = lambda s: None) -> dict:
    base = [sys.executable, "-m", "ellm.bench.spec_worker"]
    common = ["--gen", str(cfg.gen), "--rounds", str(cfg.rounds), "--threads", str(cfg.threads)]
    if cfg.tasks:
        common += ["--tasks", cfg.tasks]
    llama_path = None
    if cfg.llama_build:
        from .llama_cpp import ensure_build, get_build

        llama_path = ensure_build(get_build(cfg.llama_build), log)
    rows, raw = [], []
    for ctx in cfg.ctxs:
        log(f"eLLM, {ctx}-token prompts ...")
        drafts = ["--draft", ",".join(cfg.drafters)]
        if cfg.draft_model is not None:
            drafts += ["--draft-model", str(cfg.draft_model)]
        r = run_worker([*base, "ellm", "--artifact", str(cfg.artifact), "--ctx", str(ctx), "--chain", str(cfg.chain),
                        *drafts, *common], f"eLLM at {ctx} tokens")
        raw.append(r)
        rows += [s for t in r["tasks"] for s in _summaries("ellm", ctx, t)]
        if llama_path is not None:
            log(f"llama.cpp ({cfg.llama_build}), {ctx}-token prompts ...")
            cmd = [*base, "llama.cpp", "--model", str(cfg.model), "--llama-path", str(llama_path), "--ctx", str(ctx),
                   "--kv-type", cfg.llama_kv, *common] + ([] if cfg.llama_flash else ["--no-flash-attn"])
            r = run_worker(cmd, f"llama.cpp at {ctx} tokens")
            raw.append(r)
            rows += [s for t in r["tasks"] for s in _summaries("llama.cpp", ctx, t)]
    return {"host": detect_host().record(), "config": {k: str(v) for k, v in cfg.__dict__.items()}, "rows": rows,
            "raw": raw}


def format_spec_table(report: dict) -> str:
    lines = [f"{'task':10s} {'kind':8s} {'ctx':>5s} {'system':9s} {'draft':7s} {'plain t/s':>9s} {'spec t/s':>9s} {'x':>5s} "
             f"{'accept':>6s} {'mean acc':>8s} {'same':>4s}"]
    for r in report["rows"]:
        acc = f"{100 * r['accept_rate']:5.0f}%" if r.get("accept_rate") is not None else "     -"
        mean = f"{r['mean_accepted']:8.1f}" if r.get("mean_accepted") is not None else "       -"
        lines.append(f"{r['task']:10s} {'grounded' if r['grounded'] else 'open':8s} {r['ctx']:5d} {r['system']:9s} {r['draft']:7s} "
                     f"{r['plain_tok_s']:9.1f} {r['spec_tok_s']:9.1f} {r['speedup']:5.2f} {acc} {mean} "
                     f"{'yes' if r['identical'] else 'NO':>4s}")
    return "\n".join(lines)
