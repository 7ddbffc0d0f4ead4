"""Run as a subprocess by test_interrupts.py: generate until the parent's SIGINT arrives (mid-prefill or
mid-decode), then check the engine and print one JSON line. Markers on stdout tell the parent where it is."""

from __future__ import annotations

import json
import sys

import numpy as np

import ellm


def main(artifact: str, mode: str) -> None:
    eng = ellm.load(artifact, threads=2, ctx_size=4096)
    text = " ".join(f"Line {i}: the {['red', 'green', 'blue'][i % 3]} lamp number {i * 7} is on." for i in range(260))
    prompt = eng.tokenizer.encode(text)[: 2500 if mode == "prefill" else 200]
    out: list[int] = []

    def token(t):
        out.append(t)
        print("token", flush=True)

    def progress(done, total):
        print("chunk", flush=True)

    interrupted = False
    try:
        print("start", flush=True)
        if mode == "prefill":
            eng.generate(prompt, 8, progress=progress)
        else:
            eng.generate(prompt, 3000, stop_at_eog=False, on_token=token)
    except KeyboardInterrupt:
        interrupted = True
    cached = list(eng.slot_tokens(0))
    written = prompt + out
    report = {"interrupted": interrupted, "n_cached": len(cached), "prompt": len(prompt), "emitted": len(out),
              "cache_is_a_prefix": cached == written[: len(cached)]}

    def run(ids, n, **kw):
        rows = []
        toks = eng.generate(ids, n, on_logits=lambda t, row: rows.append(np.array(row)), **kw)
        return toks, np.stack(rows), eng.stats.reused_tokens

    if mode == "prefill":
        # reuse only what prefill steps wrote: bit for bit a fresh run (prefill does not depend on its chunking)
        toks, rows, report["reused"] = run(prompt, 8, cache_reuse=False)
        eng.reset()
        fresh, fresh_rows, _ = run(prompt, 8, cache_reuse=False)
    else:
        # the decoded tokens' KV reused, against the same steps taken without an interrupt
        toks, rows, report["reused"] = run(written, 8)
        eng.reset()
        report["same_tokens_again"] = eng.generate(prompt, len(out), stop_at_eog=False) == out
        fresh, fresh_rows, _ = run(written, 8)
    report["same_continuation"] = toks == fresh
    report["max_logit_diff"] = float(np.max(np.abs(rows - fresh_rows)))
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
