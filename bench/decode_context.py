"""Decode and prefill speed at several context lengths, on real text. Emits JSON.

    python bench/decode_context.py [--artifact DIR] [--ctx 512,4096] [--gen 64] [--repeat 3] [--threads N]

Each repeat truncates the cache back to the context length and decodes `gen` tokens; the first
`warmup` decode steps of each repeat are excluded. Prefill is timed once per context length after a
warm-up prefill of a short prompt.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return -1


def real_tokens(tok, n: int) -> list[int]:
    import tvm

    text = (Path(tvm.__file__).parent / "LICENSE").read_text()
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(text)
    return ids[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--artifact", help="artifact directory (default: the bundled model, compiled and cached)")
    ap.add_argument("--ctx", default="512,4096", help="comma-separated context lengths")
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--out", help="also write the JSON here")
    a = ap.parse_args()

    import ellm
    from ellm.bench.worker import decode_rates
    from ellm.demo import cached_artifact

    art = Path(a.artifact) if a.artifact else cached_artifact(log=lambda s: None)
    ctxs = [int(c) for c in a.ctx.split(",")]
    rss0 = rss_bytes()
    t = time.perf_counter()
    eng = ellm.load(art, threads=a.threads, ctx_size=max(ctxs) + a.gen + a.warmup + 8)
    load_s = time.perf_counter() - t
    rss_loaded = rss_bytes()
    eng.prefill(real_tokens(eng.tokenizer, 64))  # warm-up: first calls page in weights and code
    results = []
    for ctx in ctxs:
        ids = real_tokens(eng.tokenizer, ctx)
        eng.reset()
        t = time.perf_counter()
        logits = eng.prefill(ids)
        prefill_s = time.perf_counter() - t
        rates = decode_rates(eng, logits, ctx, a.gen, a.warmup, a.repeat)
        results.append(
            {
                "ctx": ctx,
                "prefill_tok_s": ctx / prefill_s,
                "decode_tok_s_median": statistics.median(rates),
                "decode_tok_s_min": min(rates),
                "decode_tok_s_max": max(rates),
            }
        )
    report = {
        "artifact": str(art),
        "threads": eng.threads,
        "load_s": load_s,
        "rss_before_load_mb": rss0 / 1e6,
        "rss_after_load_mb": rss_loaded / 1e6,
        "rss_after_run_mb": rss_bytes() / 1e6,
        "kv_cache_mb_allocated": eng.kv_bytes() / 1e6,
        "gen": a.gen,
        "warmup": a.warmup,
        "repeat": a.repeat,
        "results": results,
    }
    text = json.dumps(report, indent=1)
    print(text)
    if a.out:
        Path(a.out).write_text(text)


if __name__ == "__main__":
    main()
