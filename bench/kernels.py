"""Kernel micro-benchmarks: each decode-step kernel's time and GB/s against the measured read bandwidth.

    python bench/kernels.py [--model GGUF] [--ctx 512] [--threads N] [--target PRESET] [--json FILE]

Every kernel of the one-token (decode) entry is compiled alone and called with its real shapes. Weights
rotate through copies totalling more than the last-level cache, as in a decode step, where each
layer's weights come from DRAM. The KV cache has `ctx` tokens. Times include the Python call
(~1 us). The table ends with the sum over one decode step (calls x time) next to the measured step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

import numpy as np


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--target", default="auto", help="a target preset (default: this host's)")
    ap.add_argument("--json")
    a = ap.parse_args()

    import tvm

    from ellm.autotune.tuner import Workload, _inputs
    from ellm.bench.bandwidth import measure_read_bandwidth
    from ellm.compiler.build import CompileOptions, build_graph
    from ellm.compiler.gguf_file import GGUFFile
    from ellm.compiler.lower import lower
    from ellm.config import ModelConfig
    from ellm.kv.plan import KVPlan
    from ellm.models import resolve_model
    from ellm.runtime.engine import set_threads
    from ellm.schedules.inject_prefetch import inject_prefetch
    from ellm.targets import resolve_target

    preset = resolve_target(a.target)
    gf = GGUFFile(resolve_model(a.model))
    cfg = ModelConfig.from_gguf(gf)
    _, g = build_graph(gf, cfg, CompileOptions(), preset)
    lowered = lower(g, preset)
    lowered_plan = KVPlan.from_key(g.op("kv_cache").attr("kv_plan"))
    decode = [k for k in lowered.kernels if k.req.m == 1]
    calls = Counter()
    for _, op in g.nodes():
        for k in decode:
            if k.req.kind is op.kind and _same_shape(k.req, op):
                calls[k.name] += 1
                break
    bw = measure_read_bandwidth(a.threads)
    set_threads(a.threads)
    wl = Workload(tokens=1, ctx=a.ctx)
    rows = []
    for k in decode:
        func = inject_prefetch(lower_rule_build(k, preset)).with_attr("global_symbol", "kernel")
        ex = tvm.compile(func, target=preset.tvm_target())
        args = _inputs(func, k.req, wl, np.random.default_rng(0))
        names = _param_names(func)
        nbytes = sum(x.numpy().nbytes for n, x in zip(names, args) if n.startswith(WEIGHTS))
        # rotate copies of the weights so the working set exceeds the last-level cache
        copies = max(1, int(64e6 // nbytes)) if nbytes else 1
        sets = [_copy_weights(func, args) for _ in range(copies)] if nbytes else [args]
        if "layer" in names:  # the KV cache holds every layer: step through them, as decode does
            li = names.index("layer")
            sets = [s[:li] + [i % cfg.n_layers] + s[li + 1 :] for i, s in enumerate(sets * cfg.n_layers)]
        f = ex["kernel"]
        for s in sets:
            f(*s)
        reps = max(3, 300 // len(sets))
        times = []
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(reps // 3):
                for s in sets:
                    f(*s)
            times.append((time.perf_counter() - t) / (reps // 3 * len(sets)))
        sec = statistics.median(times)
        if k.req.kind.value == "attention":  # K and V of one layer up to ctx, at the plan's precision
            nbytes = int(lowered_plan.bytes_per_token() / cfg.n_layers * a.ctx)
        elif k.req.kind.value == "embedding":
            nbytes = nbytes // k.req.weight_shape[0]  # one row
        rows.append({"kernel": k.name, "rule": k.rule, "calls_per_step": calls[k.name], "us": sec * 1e6,
                     "bytes": nbytes, "gb_s": nbytes / sec / 1e9, "pct_bw": 100 * nbytes / sec / 1e9 / bw.gb_s_median})
    step_us = sum(r["us"] * r["calls_per_step"] for r in rows)
    report = {"bandwidth_gb_s": bw.gb_s_median, "threads": a.threads, "ctx": a.ctx, "target": preset.name, "kernels": rows,
              "sum_over_decode_step_us": step_us}
    print(f"read bandwidth {bw.gb_s_median:.1f} GB/s, {a.threads} threads, KV context {a.ctx}, target {preset.name}")
    print(f"{'kernel':44s} {'rule':18s} {'calls':>5s} {'us/call':>8s} {'MB':>7s} {'GB/s':>6s} {'%BW':>5s}")
    for r in rows:
        print(f"{r['kernel']:44s} {r['rule']:18s} {r['calls_per_step']:5d} {r['us']:8.1f} {r['bytes'] / 1e6:7.2f} "
              f"{r['gb_s']:6.1f} {r['pct_bw']:5.0f}")
    print(f"sum over one decode step: {step_us / 1e3:.2f} ms ({1e6 / step_us:.0f} tokens/s if nothing else took time)")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(report, fh, indent=1)


def lower_rule_build(k, preset):
    from ellm.schedules import rule_by_name

    return rule_by_name(k.rule).build(k.req, preset, k.knobs)


def _same_shape(req, op) -> bool:
    w = op.weight
    return (w is None and req.weight_shape is None) or (w is not None and req.weight_shape == (w.rows, w.cols))


def _param_names(func):
    return [str(p.name) for p in func.params]


WEIGHTS = ("w_", "gu_", "down_")  # packed weight components: what a decode step streams besides the KV cache


def _copy_weights(func, args):
    import tvm

    names = _param_names(func)
    return [tvm.runtime.tensor(x.numpy()) if n.startswith(WEIGHTS) else x for n, x in zip(names, args)]


if __name__ == "__main__":
    main()
