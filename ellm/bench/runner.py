"""`ellm bench`: decode and prefill speed against this machine's measured memory bandwidth, optionally vs llama.cpp.

For each context length, alternate the systems for `rounds` rounds, each run in a fresh process and
bracketed by fresh measurements of the read bandwidth, before and after (this machine's bandwidth drifts
by tens of percent within minutes). A run is set against the higher of its two: the bound must be what the
machine could read while the run ran, or a dip in the measurement would flatter it. The systems are eLLM
(one target of its artifact) and any llama.cpp configurations asked for: a build per ISA class
(bench/llama_cpp.py), a KV cache type, flash attention on or off. Decode rates exclude warm-up steps; the
report gives the median and the spread over all repeats, bytes read per decoded token, achieved GB/s, the % of the bandwidth measured around each run
(median over runs), the ISA path each system ran, and eLLM against the best llama.cpp configuration
of each build.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from ..errors import EllmError
from ..kv.attention import AttentionConfig


@dataclass(frozen=True)
class LlamaConfig:
    """One llama.cpp configuration: its build (bench/llama_cpp.py), KV cache type and flash attention."""

    build: str = "native"
    kv_type: str = "f16"
    flash_attn: bool = True

    def __post_init__(self) -> None:
        if self.kv_type not in ("f16", "q8_0"):
            raise EllmError(f"llama.cpp KV type must be f16 or q8_0, got {self.kv_type!r}")
        if self.kv_type != "f16" and not self.flash_attn:
            raise EllmError("llama.cpp needs flash attention for a quantised V cache")

    @property
    def name(self) -> str:
        return f"llama.cpp/{self.build}/{self.kv_type}/{'fa' if self.flash_attn else 'nofa'}"


def llama_configs(builds, kv_types, flash) -> tuple[LlamaConfig, ...]:
    """Every valid combination (a quantised cache only with flash attention)."""
    return tuple(LlamaConfig(b, k, f) for b in builds for k in kv_types for f in flash if k == "f16" or f)


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
    llama: tuple[LlamaConfig, ...] = ()  # llama.cpp configurations to compare against (none: eLLM alone)
    target: str | None = None  # eLLM: this target of the artifact (default: the best this CPU runs)
    attention: tuple = ()  # (field, value) overrides of each artifact's planned AttentionConfig
    rope_scaling: tuple[str, float] | None = None  # (kind, factor), for contexts past the trained one
    others: tuple[Path, ...] = ()  # more eLLM artifacts of the same model (a tuned build, say), alternated too


def artifact_system(path: Path) -> str:
    """The report's name for a compared eLLM artifact."""
    return f"ellm[{Path(path).name}]"


def _worker(system: str, cfg: BenchConfig, ctx: int, llama: LlamaConfig | None = None, llama_path: Path | None = None,
            artifact: Path | None = None) -> dict:
    kind = "llama.cpp" if llama is not None else "ellm" if system.startswith("ellm") else system
    cmd = [sys.executable, "-m", "ellm.bench.worker", kind, "--threads", str(cfg.threads)]
    if kind != "bandwidth":
        cmd += ["--model", str(cfg.model), "--ctx", str(ctx), "--gen", str(cfg.gen), "--warmup", str(cfg.warmup),
                "--repeat", str(cfg.repeat)]
        if cfg.rope_scaling is not None:
            cmd += ["--rope-scaling", cfg.rope_scaling[0], "--rope-scale", repr(cfg.rope_scaling[1])]
    if kind == "ellm":
        from ..cli import attention_argv

        cmd += ["--artifact", str(artifact or cfg.artifact), *attention_argv(cfg.attention)]
        if cfg.target:
            cmd += ["--target", cfg.target]
    if llama is not None:
        cmd += ["--llama-path", str(llama_path), "--kv-type", llama.kv_type] + ([] if llama.flash_attn else ["--no-flash-attn"])
    return run_worker(cmd, f"{system} benchmark at context {ctx}")


def run_worker(cmd: list[str], what: str) -> dict:
    """Run a benchmark worker process; its JSON report, or one line saying how it failed."""
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode < 0:
        raise EllmError(f"{what} was killed by {signal.Signals(-proc.returncode).name}"
                        + (" (an instruction this CPU lacks: another build?)" if proc.returncode == -signal.SIGILL else ""))
    if proc.returncode != 0:
        raise EllmError(f"{what} failed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(proc.stdout)


def _attention(manifest: dict, cfg: BenchConfig) -> AttentionConfig:
    """What an artifact's eLLM run reads: its planned attention with the bench's overrides."""
    return AttentionConfig.from_dict(manifest.get("attention", {})).with_overrides(cfg.attention)


def decode_bytes_per_token(manifest: dict, ctx: int, gen: int, attention: AttentionConfig | None = None,
                           kv_bytes_per_value: float = 2.0) -> int:
    """Weights read by one decode step plus the KV it attends over, at the mean context of the timed steps:
    with `attention`, the blocks of the artifact's plan it reads and the key summaries it ranks
    (KVPlan.read_bytes, as the tuner's harness counts them); without, llama.cpp's cache
    (`kv_bytes_per_value`: 2 for f16, 34/32 for q8_0) over the whole context."""
    from ..kv.plan import KVPlan

    weights = manifest["targets"][0]["decode_weight_bytes"]
    n_ctx = int(ctx + gen / 2)
    if attention is None:
        cfg = manifest["config"]
        per_token = 2 * cfg["n_layers"] * cfg["n_kv_heads"] * cfg["head_dim"] * kv_bytes_per_value
        return int(weights + per_token * n_ctx)
    return int(weights + KVPlan.from_dict(manifest["kv_cache"]).read_bytes(n_ctx, attention))


def _row(system: str, ctx: int, runs: list[dict], nbytes: int) -> dict:
    rates = [x for run in runs for x in run["decode_tok_s"]]
    med = statistics.median(rates)
    prefill = [ctx / run["prefill_s"] for run in runs]
    bws = [max(run["bandwidth_gb_s_around"]) for run in runs]
    pcts = [100 * statistics.median(run["decode_tok_s"]) * nbytes / 1e9 / bw for run, bw in zip(runs, bws)]
    return {
        "system": system,
        "isa": runs[0].get("isa"),
        "target": runs[0].get("target"),
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
        "bandwidth_gb_s_per_run": bws,  # the higher of the two measured around each run
        "bandwidth_gb_s_around_per_run": [run["bandwidth_gb_s_around"] for run in runs],  # [before, after]
        "pct_of_bandwidth": statistics.median(pcts),
        "bound_tok_s": statistics.median(bws) * 1e9 / nbytes,
    }


def run_bench(cfg: BenchConfig, log: Callable[[str], None] = lambda s: None) -> dict:
    from ..kv.plan import KVPlan
    from ..runtime.artifact import Artifact
    from .llama_cpp import ensure_build, get_build

    manifest = Artifact.open(cfg.artifact, target=cfg.target).manifest
    manifests = {"ellm": manifest} | {artifact_system(p): Artifact.open(p, target=cfg.target).manifest for p in cfg.others}
    if len(manifests) != 1 + len(cfg.others):
        raise EllmError("compared artifacts need distinct directory names")
    for name, m in manifests.items():
        if m["source"]["sha256"] != manifest["source"]["sha256"]:
            raise EllmError(f"{name} was compiled from another model than {cfg.artifact}")
    paths = {b: ensure_build(get_build(b), log) for b in sorted({c.build for c in cfg.llama})}
    artifacts = {"ellm": cfg.artifact} | {artifact_system(p): p for p in cfg.others}
    systems: list[tuple[str, LlamaConfig | None]] = [(n, None) for n in artifacts] + [(c.name, c) for c in cfg.llama]
    rows = []
    for ctx in cfg.ctxs:
        nbytes_of = {name: decode_bytes_per_token(manifests[name], ctx, cfg.gen, _attention(manifests[name], cfg)) if c is None else
                     decode_bytes_per_token(manifest, ctx, cfg.gen, kv_bytes_per_value=2.0 if c.kv_type == "f16" else 34 / 32)
                     for name, c in systems}
        runs: dict[str, list[dict]] = {name: [] for name, _ in systems}
        for r in range(cfg.rounds):
            for name, c in systems:  # alternate A, B, A, B: all see the same drift of a shared machine
                before = _worker("bandwidth", cfg, ctx)["gb_s"]
                run = _worker(name, cfg, ctx, c, paths.get(c.build) if c else None, artifacts.get(name))
                after = _worker("bandwidth", cfg, ctx)["gb_s"]
                run["bandwidth_gb_s_around"] = [before, after]
                bw = max(before, after)
                runs[name].append(run)
                rate = statistics.median(run["decode_tok_s"])
                log(f"context {ctx} round {r + 1} {name:26s} [{run.get('isa')}] decode {rate:7.1f} tok/s, prefill "
                    f"{ctx / run['prefill_s']:7.1f} tok/s, bandwidth {bw:5.1f} GB/s "
                    f"({100 * rate * nbytes_of[name] / 1e9 / bw:.0f}%)")
        rows += [_row(name, ctx, runs[name], nbytes_of[name]) for name, _ in systems]
    from ..targets import detect_host

    return {
        "host": detect_host().record(),
        "artifact": str(cfg.artifact),
        "model": cfg.model.name,
        "threads": cfg.threads,
        "gen": cfg.gen,
        "warmup": cfg.warmup,
        "repeat": cfg.repeat,
        "rounds": cfg.rounds,
        "kv_cache": KVPlan.from_dict(manifest["kv_cache"]).describe(),
        "kv_plan": {"k": manifest["kv_cache"]["k"], "v": manifest["kv_cache"]["v"], "block": manifest["kv_cache"]["block"]},
        "attention": _attention(manifest, cfg).describe(),
        "rope_scaling": list(cfg.rope_scaling) if cfg.rope_scaling else None,
        "llama_cpp": [c.name for c in cfg.llama],
        "compared_artifacts": {artifact_system(p): str(p) for p in cfg.others},
        "rows": rows,
        "ratios": ratios(rows, cfg.ctxs, cfg.llama),
        "artifact_ratios": artifact_ratios(rows, cfg.ctxs, [artifact_system(p) for p in cfg.others]),
    }


def artifact_ratios(rows: list[dict], ctxs, names: list[str]) -> list[dict]:
    """Each compared artifact against the main one, per context."""
    out = []
    for ctx in ctxs:
        e = next(r for r in rows if r["ctx"] == ctx and r["system"] == "ellm")
        for name in names:
            o = next(r for r in rows if r["ctx"] == ctx and r["system"] == name)
            out.append({"ctx": ctx, "system": name, "decode_ratio": o["decode_tok_s"] / e["decode_tok_s"],
                        "prefill_ratio": o["prefill_tok_s"] / e["prefill_tok_s"]})
    return out


def ratios(rows: list[dict], ctxs, llama: tuple[LlamaConfig, ...]) -> list[dict]:
    """eLLM against the fastest llama.cpp configuration of each build, per context (decode and prefill each
    against their own best)."""
    out = []
    for ctx in ctxs:
        e = next(r for r in rows if r["ctx"] == ctx and r["system"] == "ellm")
        for build in sorted({c.build for c in llama}):
            peers = [r for r in rows if r["ctx"] == ctx and r["system"] in {c.name for c in llama if c.build == build}]
            dec = max(peers, key=lambda r: r["decode_tok_s"])
            pre = max(peers, key=lambda r: r["prefill_tok_s"])
            out.append({"ctx": ctx, "build": build, "isa": dec["isa"], "ellm_isa": e["isa"],
                        "decode_ratio": e["decode_tok_s"] / dec["decode_tok_s"], "decode_vs": dec["system"],
                        "prefill_ratio": e["prefill_tok_s"] / pre["prefill_tok_s"], "prefill_vs": pre["system"]})
    return out


def format_table(report: dict) -> str:
    lines = [
        f"{report['model']}, {report['threads']} threads, eLLM: {report['attention']}, {report['kv_cache']}; "
        f"decode {report['gen']} tokens "
        f"x {report['repeat']} repeats x {report['rounds']} rounds (median [min-max])",
        f"{'ctx':>6} {'system':26} {'ISA':13} {'prefill tok/s':>14} {'decode tok/s':>22} {'MB/token':>9} {'GB/s':>6} "
        f"{'% of BW':>8} {'BW GB/s':>8}",
    ]
    for r in report["rows"]:
        lines.append(
            f"{r['ctx']:>6} {r['system']:26} {str(r['isa']):13} {r['prefill_tok_s']:>14.1f} "
            f"{r['decode_tok_s']:>8.1f} [{r['decode_tok_s_min']:.1f}-{r['decode_tok_s_max']:.1f}]".ljust(88)
            + f" {r['bytes_per_token'] / 1e6:>9.1f} {r['achieved_gb_s']:>6.1f} {r['pct_of_bandwidth']:>7.1f}% "
            f"{r['bandwidth_gb_s']:>8.1f}"
        )
    for q in report.get("artifact_ratios", []):
        lines.append(f"ctx {q['ctx']}: {q['system']} / ellm = {q['decode_ratio']:.3f}x decode, "
                     f"{q['prefill_ratio']:.3f}x prefill")
    for q in report["ratios"]:
        lines.append(f"ctx {q['ctx']}: eLLM ({q['ellm_isa']}) / llama.cpp {q['build']} ({q['isa']}) = "
                     f"{q['decode_ratio']:.2f}x decode (vs {q['decode_vs']}), {q['prefill_ratio']:.2f}x prefill "
                     f"(vs {q['prefill_vs']})")
    return "\n".join(lines)
