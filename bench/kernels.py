"""Kernel micro-benchmarks: each kernel of a decode step (or of a prefill chunk) alone, against the measured read
bandwidth (decode) or as multiply-accumulates per second (prefill).

    python bench/kernels.py [--model GGUF] [--ctx 512] [--tokens T [--verify]] [--threads N] [--target PRESET] [--cold]
                            [--knob RULE.KNOB=VALUE] [--activations A] [--json FILE]

Every kernel of the one-token entry (or, with --tokens, of the prefill entry at T tokens; with --verify, of the
verification entry) is compiled alone and called with its real shapes, by the tuner's timing harness (ellm/autotune/measure.py): weights and KV
blocks rotate through copies until a pass reads what one decode step reads at `ctx` (the reuse distance a
step gives each byte; at most four times the last-level cache), or with --cold four times the last-level
cache whatever the step. Times include the Python call (~1 us). The table ends with the sum over one step
(calls x time), to set beside the decode rate `ellm bench` measures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections import Counter

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=0, help="profile the prefill entry at this many tokens (default: decode)")
    ap.add_argument("--verify", action="store_true",
                    help="with --tokens: profile the verification entry (rows computed as one-token steps) instead")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target", default="auto", help="a target preset (default: this host's)")
    ap.add_argument("--knob", action="append", default=[], metavar="RULE.KNOB=VALUE",
                    help="override a knob of one rule's kernels (repeatable), e.g. attention_input.passes=4")
    ap.add_argument("--activations", default="auto", help="as `ellm compile --activations`")
    ap.add_argument("--cold", action="store_true",
                    help="rotate one-token kernels' bytes through 4x the last-level cache, not the step's reuse distance")
    ap.add_argument("--json")
    a = ap.parse_args()
    overrides = _parse_knobs(a.knob)

    from ellm.autotune.measure import Workload, inputs, last_level_cache, reuse_bytes, time_calls, timing_sets
    from ellm.autotune.tuner import model_workload
    from ellm.autotune.runner import call_bytes
    from ellm.bench.bandwidth import measure_read_bandwidth
    from ellm.compiler.build import CompileOptions, build_graph
    from ellm.compiler.gguf_file import GGUFFile
    from ellm.compiler.lower import ENTRIES, lower
    from ellm.compiler.tir_pipeline import compile_tir
    from ellm.config import ModelConfig
    from ellm.models import resolve_model
    from ellm.runtime.threads import set_threads
    from ellm.targets import detect_host, resolve_target

    preset = resolve_target(a.target)
    gf = GGUFFile(resolve_model(a.model))
    cfg = ModelConfig.from_gguf(gf)
    _, g = build_graph(gf, cfg, CompileOptions(activations=a.activations), preset)
    prefill = a.tokens > 0
    if a.verify and not prefill:
        raise SystemExit("--verify needs --tokens")
    verify = [e for e in ENTRIES if e.steps]
    lowered = lower(g, preset, entries=verify) if a.verify else lower(g, preset)
    # decode: the m=1 kernels; prefill: the symbolic-token kernels (and the head on the last row)
    head = lambda k: k.req.kind.value == "lm_head"  # noqa: E731
    if a.verify:  # the verification step's kernels: its head projects every row
        step = list(lowered.kernels)
    elif prefill:  # the chunk's kernels; its head projects the last row only
        step = [k for k in lowered.kernels if (k.req.m is None and not head(k)) or k.req.attr("last_row")]
    else:  # the one-token kernels, the head included (the decode entry shares the last-row head kernel)
        step = [k for k in lowered.kernels if k.req.m == 1]
    calls = Counter()
    for _, op in g.nodes():
        for k in step:
            if k.req.kind is op.kind and _same_shape(k.req, op) and _same_attrs(k.req, op):
                calls[k.name] += 1
                break
    step = [k for k in step if calls[k.name]]
    unknown = set(overrides) - {k.rule for k in step}
    if unknown:
        raise SystemExit(f"--knob: no kernel of this step uses rule {', '.join(sorted(unknown))} "
                         f"(rules: {', '.join(sorted({k.rule for k in step}))})")
    bw = measure_read_bandwidth(a.threads)
    set_threads(a.threads)
    wl = model_workload(Workload(tokens=max(1, a.tokens), ctx=a.ctx), cfg, g)
    timed = dataclasses.replace(wl, step_bytes=0) if a.cold else wl  # step_bytes 0: cold (measure.reuse_bytes)
    reuse = 0 if prefill else reuse_bytes(timed, last_level_cache())
    rows = []
    for k in step:
        func = lower_rule_build(k, preset, overrides.get(k.rule)).with_attr("global_symbol", "kernel")
        ex = compile_tir(func, preset)
        args = inputs(func, k.req, wl, np.random.default_rng(0))
        nbytes = call_bytes(func, k.req, args, wl)
        # decode: weights and the KV cache read at the step's reuse distance (measure.py), its layers stepped through
        sets = timing_sets(func, k.req, args, timed, not prefill)
        sec = time_calls(ex["kernel"], sets, 1 if prefill else 100)
        del sets  # up to a quarter of the memory (measure.COPY_MEMORY_SHARE): freed before the next kernel's
        row = {"kernel": k.name, "rule": k.rule, "calls_per_step": calls[k.name], "us": sec * 1e6}
        if prefill:
            macs = _macs(k.req, a.tokens)
            row.update(gmac_s=macs / sec / 1e9 if macs else None)
        else:
            if k.req.kind.value == "embedding":
                nbytes = nbytes // k.req.weight_shape[0]  # one row
            row.update(bytes=nbytes, gb_s=nbytes / sec / 1e9, pct_bw=100 * nbytes / sec / 1e9 / bw.gb_s_median)
        rows.append(row)
    step_us = sum(r["us"] * r["calls_per_step"] for r in rows)
    report = {"host": detect_host().record(), "bandwidth_gb_s": bw.gb_s_median, "threads": a.threads, "ctx": a.ctx,
              "tokens": a.tokens, "step_bytes": wl.step_bytes, "reuse_bytes": reuse, "target": preset.name, "kernels": rows,
              "sum_over_step_us": step_us}
    what = f"{'verification step' if a.verify else 'prefill chunk'} of {a.tokens} tokens" if prefill else "decode step"
    print(f"read bandwidth {bw.gb_s_median:.1f} GB/s, {a.threads} threads, KV context {a.ctx}, target {preset.name}, {what}"
          + ("" if prefill else f", bytes reread after {reuse / 1e6:.0f} MB"))
    if prefill:
        print(f"{'kernel':44s} {'rule':18s} {'calls':>5s} {'us/call':>9s} {'GMAC/s':>7s} {'% step':>7s}")
        for r in rows:
            gm = f"{r['gmac_s']:7.1f}" if r["gmac_s"] else "      -"
            print(f"{r['kernel']:44s} {r['rule']:18s} {r['calls_per_step']:5d} {r['us']:9.1f} {gm} "
                  f"{100 * r['us'] * r['calls_per_step'] / step_us:6.1f}%")
        print(f"sum over one chunk: {step_us / 1e3:.2f} ms ({a.tokens * 1e6 / step_us:.0f} tokens/s if nothing else took time)")
    else:
        print(f"{'kernel':44s} {'rule':18s} {'calls':>5s} {'us/call':>8s} {'MB':>7s} {'GB/s':>6s} {'%BW':>5s} {'% step':>7s}")
        for r in rows:
            print(f"{r['kernel']:44s} {r['rule']:18s} {r['calls_per_step']:5d} {r['us']:8.1f} {r['bytes'] / 1e6:7.2f} "
                  f"{r['gb_s']:6.1f} {r['pct_bw']:5.0f} {100 * r['us'] * r['calls_per_step'] / step_us:6.1f}%")
        print(f"sum over one decode step: {step_us / 1e3:.2f} ms ({1e6 / step_us:.0f} tokens/s if nothing else took time)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=1)


def _macs(req, tokens: int) -> int:
    """Multiply-accumulates of a matmul-like kernel over `tokens` rows (its weights' rows x columns per row)."""
    if req.weight_shape is None:
        return 0
    rows = 1 if req.attr("last_row") else tokens
    n, k = req.weight_shape
    total = n * k + sum(r * c for _, r, c, _ in req.more_weights)
    return rows * total


def lower_rule_build(k, preset, overrides=None):
    """The kernel as compile builds it (prefetch injected), with `overrides` ({knob: value}) on top of its knobs."""
    from ellm.schedules import rule_by_name

    rule = rule_by_name(k.rule)
    knobs = rule.resolve_knobs(k.req, preset, {**k.knobs, **(overrides or {})}) if overrides else k.knobs
    return rule.build_kernel(k.req, preset, knobs)


def _parse_knobs(items: list[str]) -> dict[str, dict[str, int]]:
    """["rule.knob=3", ...] -> {rule: {knob: 3}}."""
    out: dict[str, dict[str, int]] = {}
    for item in items:
        name, _, value = item.partition("=")
        rule, _, knob = name.partition(".")
        if not (rule and knob and value.lstrip("-").isdigit()):
            raise SystemExit(f"--knob {item!r}: expected RULE.KNOB=INTEGER")
        out.setdefault(rule, {})[knob] = int(value)
    return out


def _same_shape(req, op) -> bool:
    w = op.weight
    if w is None:
        return req.weight_shape is None
    return req.weight_shape == (w.rows, w.cols) and req.qtype is w.qtype


def _same_attrs(req, op) -> bool:
    """The op's attributes as the kernel request carries them (per-layer KV classes, residual, ...; lowering
    turns the two activation widths into the request's one)."""
    return all(req.attr(k) == v for k, v in op.attrs if k not in ("act_bits", "chunk_act_bits"))


if __name__ == "__main__":
    main()
