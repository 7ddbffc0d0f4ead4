"""`ellm bench`: decode and prefill speed against this machine's measured memory bandwidth, optionally vs llama.cpp.

For each context length, alternate the systems for `rounds` rounds, each run in a fresh process and
preceded by a fresh measurement of the read bandwidth (this machine's bandwidth drifts by tens of
percent within minutes). Decode rates exclude warm-up steps; the report gives the median and the
spread over all repeats, bytes read per decoded token, achieved GB/s, and the % of the bandwidth
measured just before each run (median over runs).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import EllmError
from ..kv.attention import AttentionConfig


@dataclass(frozen=True)
class BenchConfig:
    artifact: Path
    model: Path
    ctxs: tuple[int, ...] = (512, 2048, 8000)
    gen: int = 64
    warmup: int = 4
    repeat: int = 3
    rounds: int = 2
    threads: int = os.cpu_count() or 1
    vs_llama_cpp: bool = False
    attention: AttentionConfig = AttentionConfig()
    rope_scaling: tuple[str, float] | None = None  # (kind, factor), for contexts past the trained one


def ensure_llama_cpp(log: Callable[[str], None]) -> None:
    """Import llama_cpp, installing the optional peer on demand (it builds llama.cpp: about 5 minutes)."""
    try:
        import llama_cpp  # noqa: F401

        return
    except ImportError:
        pass
    log("llama-cpp-python is not installed; installing it now (builds llama.cpp from source, ~5 minutes) ...")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "llama-cpp-python"], capture_output=True, text=True)
    if proc.returncode != 0:
        raise EllmError(f"could not install llama-cpp-python: {proc.stderr.strip().splitlines()[-1] if proc.stderr else ''}")


def _worker(system: str, cfg: BenchConfig, ctx: int) -> dict:
    cmd = [sys.executable, "-m", "ellm.bench.worker", system, "--threads", str(cfg.threads)]
    if system != "bandwidth":
        cmd += ["--model", str(cfg.model), "--ctx", str(ctx), "--gen", str(cfg.gen), "--warmup", str(cfg.warmup),
                "--repeat", str(cfg.repeat)]
    if system != "bandwidth" and cfg.rope_scaling is not None:
        cmd += ["--rope-scaling", cfg.rope_scaling[0], "--rope-scale", repr(cfg.rope_scaling[1])]
    if system == "ellm":
        from ..cli import attention_argv

        cmd += ["--artifact", str(cfg.artifact), *attention_argv(cfg.attention)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise EllmError(f"{system} benchmark at context {ctx} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(proc.stdout)


def decode_bytes_per_token(manifest: dict, ctx: int, gen: int, attention: AttentionConfig | None = None) -> int:
    """Weights read by one decode step plus the KV it attends over, at the mean context of the timed steps:
    with `attention`, the keys and values the artifact's plan stores for the blocks it reads and the key
    summaries it ranks; without, llama.cpp's F16 cache over the whole context."""
    from ..kv.plan import KVPlan

    weights = manifest["targets"][0]["decode_weight_bytes"]
    n_ctx = int(ctx + gen / 2)
    if attention is None:
        return int(weights + f16_kv_bytes_per_token(manifest) * n_ctx)
    plan = KVPlan.from_dict(manifest["kv_cache"])
    keys, candidates = attention.blocks_read(n_ctx, plan.block, plan.recent)
    summary = 2 * plan.head_dim * 2 * plan.n_kv_heads * plan.n_layers  # (min, scale) or (min, max), f16
    return int(weights + plan.bytes_per_token() * keys + summary * candidates)


def f16_kv_bytes_per_token(manifest: dict) -> int:
    """llama.cpp's F16 cache: K and V of every layer and KV head."""
    cfg = manifest["config"]
    return 2 * cfg["n_layers"] * cfg["n_kv_heads"] * cfg["head_dim"] * 2


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = lambda s: None) -> dict:
    from ..kv.plan import KVPlan
    from ..runtime.artifact import Artifact

    manifest = Artifact.open(cfg.artifact).manifest
    systems = ["ellm"] + (["llama.cpp"] if cfg.vs_llama_cpp else [])
    if cfg.vs_llama_cpp:
        ensure_llama_cpp(log)
    rows = []
    for ctx in cfg.ctxs:
        # what each system's decode step must read: eLLM's cache per its plan, llama.cpp's in F16
        nbytes_of = {"ellm": decode_bytes_per_token(manifest, ctx, cfg.gen, cfg.attention),
                     "llama.cpp": decode_bytes_per_token(manifest, ctx, cfg.gen)}
        runs: dict[str, list[dict]] = {s: [] for s in systems}
        for r in range(cfg.rounds):
            for s in systems:  # alternate A, B, A, B: both see the same drift of a shared machine
                bw = _worker("bandwidth", cfg, ctx)["gb_s"]
                run = _worker(s, cfg, ctx)
                run["bandwidth_gb_s"] = bw
                runs[s].append(run)
                rate = statistics.median(run["decode_tok_s"])
                nbytes = nbytes_of[s]
                log(f"context {ctx} round {r + 1} {s:9s} decode {rate:7.1f} tok/s, bandwidth {bw:5.1f} GB/s "
                    f"({100 * rate * nbytes / 1e9 / bw:.0f}%)")
        for s in systems:
            nbytes = nbytes_of[s]
            rates = [x for run in runs[s] for x in run["decode_tok_s"]]
            med = statistics.median(rates)
            prefill = [ctx / run["prefill_s"] for run in runs[s]]
            bws = [run["bandwidth_gb_s"] for run in runs[s]]
            pcts = [100 * statistics.median(run["decode_tok_s"]) * nbytes / 1e9 / run["bandwidth_gb_s"] for run in runs[s]]
            rows.append(
                {
                    "system": s,
                    "ctx": ctx,
                    "decode_tok_s": med,
                    "decode_tok_s_min": min(rates),
                    "decode_tok_s_max": max(rates),
                    "prefill_tok_s": statistics.median(prefill),
                    "prefill_tok_s_min": min(prefill),
                    "prefill_tok_s_max": max(prefill),
                    "bytes_per_token": nbytes,
                    "achieved_gb_s": med * nbytes / 1e9,
                    "bandwidth_gb_s": statistics.median(bws),
                    "bandwidth_gb_s_per_run": bws,
                    "pct_of_bandwidth": statistics.median(pcts),
                    "bound_tok_s": statistics.median(bws) * 1e9 / nbytes,
                }
            )
    ratios = []
    if cfg.vs_llama_cpp:
        for ctx in cfg.ctxs:
            e, l = (next(r for r in rows if r["ctx"] == ctx and r["system"] == s) for s in ("ellm", "llama.cpp"))
            ratios.append({"ctx": ctx, "decode_ratio": e["decode_tok_s"] / l["decode_tok_s"],
                           "prefill_ratio": e["prefill_tok_s"] / l["prefill_tok_s"]})
    return {
        "artifact": str(cfg.artifact),
        "model": cfg.model.name,
        "threads": cfg.threads,
        "gen": cfg.gen,
        "warmup": cfg.warmup,
        "repeat": cfg.repeat,
        "rounds": cfg.rounds,
        "kv_cache": KVPlan.from_dict(manifest["kv_cache"]).describe(),
        "kv_plan": {"k": manifest["kv_cache"]["k"], "v": manifest["kv_cache"]["v"], "block": manifest["kv_cache"]["block"]},
        "attention": cfg.attention.describe(),
        "rope_scaling": list(cfg.rope_scaling) if cfg.rope_scaling else None,
        "rows": rows,
        "ratios": ratios,
    }


def format_table(report: dict) -> str:
    lines = [
        f"{report['model']}, {report['threads']} threads, eLLM: {report['attention']}, {report['kv_cache']}; "
        f"decode {report['gen']} tokens "
        f"x {report['repeat']} repeats x {report['rounds']} rounds (median [min-max])",
        f"{'ctx':>6} {'system':10} {'prefill tok/s':>14} {'decode tok/s':>22} {'MB/token':>9} {'GB/s':>6} "
        f"{'% of BW':>8} {'BW GB/s':>8}",
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['ctx']:>6} {r['system']:10} {r['prefill_tok_s']:>14.1f} "
            f"{r['decode_tok_s']:>8.1f} [{r['decode_tok_s_min']:.1f}-{r['decode_tok_s_max']:.1f}]".ljust(61)
            + f" {r['bytes_per_token'] / 1e6:>9.1f} {r['achieved_gb_s']:>6.1f} {r['pct_of_bandwidth']:>7.1f}% "
            f"{r['bandwidth_gb_s']:>8.1f}"
        )
    for q in report["ratios"]:
        lines.append(f"ctx {q['ctx']}: eLLM / llama.cpp = {q['decode_ratio']:.2f}x decode, {q['prefill_ratio']:.2f}x prefill")
    return "\n".join(lines)
