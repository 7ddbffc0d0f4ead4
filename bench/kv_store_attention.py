"""Decode attention of one layer over a filled q4 cache, plain against protected store (kv/plan.py: the pinned
float16 first block and Hadamard-rotated keys), timed alternately in one process: what the store itself costs.

    TVM_NUM_THREADS=2 .venv/bin/python bench/kv_store_attention.py [--ctx 8000] [--rounds 30] [--calls 50]

Prints one JSON object: microseconds per call, median and min over rounds, per store. Uses the test suite's
kernel builders (tests/kernels.py, tests/kvcache.py)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))


def decode_call(protected: bool, ctx: int, H: int = 9, Hkv: int = 3, hd: int = 64):
    import tvm
    from kernels import build, build_request
    from kvcache import empty_state, layer_args
    from test_kv_cache import _requests

    from ellm.kv.attention import AttentionConfig
    from ellm.kv.plan import KVPlan, KVType

    plan = KVPlan.uniform(1, Hkv, hd, KVType.Q4, KVType.Q4, max_chunk=256, pinned=int(protected), rotate_k=protected)
    app, (_, dec) = _requests(plan, H, 0)
    f_app = build(build_request(app)[1])["kv_append"]
    f_dec = build(build_request(dec)[1])["attention"]
    rng = np.random.default_rng(7)
    k = (rng.standard_normal((Hkv, ctx, hd)) * 2).astype(np.float32)
    v = rng.standard_normal((Hkv, ctx, hd)).astype(np.float32)
    state = [tvm.runtime.tensor(a) for a in empty_state(plan, ctx)]
    args = layer_args(plan, 0, state)
    for pos in range(0, ctx, 256):
        n = min(256, ctx - pos)
        rows = [tvm.runtime.tensor(np.ascontiguousarray(x[:, pos : pos + n].transpose(1, 0, 2).reshape(n, -1))) for x in (k, v)]
        f_app(*args, *rows, pos, 0, 0, 0)
    q = tvm.runtime.tensor(rng.standard_normal((1, H * hd)).astype(np.float32))
    out = tvm.runtime.tensor(np.zeros((1, H * hd), np.float32))
    att = tvm.runtime.tensor(AttentionConfig().as_array())
    return lambda: f_dec(q, *args, att, ctx - 1, 0, 0, 0, out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ctx", type=int, default=8000)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--calls", type=int, default=50)
    a = ap.parse_args()
    calls = {name: decode_call(name == "protected", a.ctx) for name in ("plain", "protected")}
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(a.rounds):
        for name, f in calls.items():  # alternating, each round warmed by one call
            f()
            t = time.perf_counter()
            for _ in range(a.calls):
                f()
            times[name].append((time.perf_counter() - t) / a.calls * 1e6)
    print(json.dumps({"ctx": a.ctx, "rounds": a.rounds, "calls": a.calls,
                      "us_per_call": {n: {"median": float(np.median(t)), "min": float(np.min(t))} for n, t in times.items()}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
