"""`ellm compile --tp N` and `ellm run` on a tensor-parallel group."""

from __future__ import annotations

import argparse
import json
import sys
import time

from ..errors import EllmError


def add_compile_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="compile an N-way tensor-parallel group (one artifact per rank: its attention heads, FFN rows "
                        "and vocabulary rows), run by `ellm run` as one Disco worker per rank")


def compile_group_cmd(a: argparse.Namespace, options) -> int:
    from .build import compile_group

    t = time.perf_counter()
    g = compile_group(a.model, a.output, a.tp, options, force=a.force, log=lambda s: print(s, file=sys.stderr))
    print(f"wrote {g.path}: {g.world} ranks in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return 0


# `ellm run` options a group does not take yet, with their defaults
_UNSUPPORTED = {"prompt_cache": None, "rope_scaling": None, "target": None, "speculative_chain": 0,
                "draft_model": None, "attention": None, "numa": None, "mlock": False}


def run_group(a: argparse.Namespace, text: str) -> int:
    """Generate with a tensor-parallel group and report as `ellm run` does, plus the collectives' traffic."""
    from ..runtime.sampling_cli import sampling_option, stops_option
    from ..runtime.textstream import TextStream
    from .engine import ParallelEngine

    given = [k for k, d in _UNSUPPORTED.items() if getattr(a, k, d) not in (d, None)]
    if given:
        raise EllmError(f"a tensor-parallel group does not take --{given[0].replace('_', '-')} yet")
    from ..numa.topology import allowed_cpus

    t = time.perf_counter()
    eng = ParallelEngine(a.artifact, ctx_size=a.ctx_size, cpus=sorted(allowed_cpus())[: a.threads] if a.threads else None)
    load_s = time.perf_counter() - t
    try:
        tok = eng.tokenizer
        ids = tok.encode_chat([{"role": "user", "content": text}]) if a.chat else tok.encode(text)
        stream = TextStream(tok, stops_option(a))
        pieces: list[str] = []

        def on_token(t: int) -> bool:
            pieces.append(stream.feed(t))
            if pieces[-1] and not a.json:
                sys.stdout.write(pieces[-1])
                sys.stdout.flush()
            return stream.stopped

        new = eng.generate(ids, a.n_predict, sampling=sampling_option(a), on_token=on_token)
        pieces.append(stream.finish())
    finally:
        eng.close()
    st = eng.stats
    per_token = eng.decode_traffic.per(st.decode_steps)
    if a.json:
        print(json.dumps({"text": "".join(pieces), "tokens": new, "prompt_tokens": st.prompt_tokens,
                          "prefill_tok_s": st.prefill_tok_s, "decode_tok_s": st.decode_tok_s,
                          "decode_tokens": st.decode_tokens, "stop_reason": st.stop_reason, "ranks": eng.world,
                          "cpus": [list(c) for c in eng.cpus], "ctx_size": eng.ctx_size, "load_s": load_s,
                          "collectives_per_token": per_token}))
    else:
        sys.stdout.write(pieces[-1] + "\n")
        print(f"[prompt {st.prompt_tokens} tokens: prefill {st.prefill_tok_s:.1f} tok/s | decode {st.decode_tokens} "
              f"tokens: {st.decode_tok_s:.1f} tok/s | stop: {st.stop_reason} | {eng.world} ranks on CPUs "
              f"{' / '.join(','.join(map(str, c)) for c in eng.cpus)} | a decode step: "
              f"{per_token['collectives']:.0f} collectives, {per_token['bytes_in'] / 1e3:.1f} kB read from the other "
              "ranks]", file=sys.stderr)
    return 0
