"""One benchmark measurement in its own process (so no two thread pools ever compete for the cores).

    python -m ellm.bench.worker ellm --model M --artifact DIR [--target T] --ctx N --gen G --warmup W --repeat R --threads T
    python -m ellm.bench.worker llama.cpp --model M --llama-path DIR [--kv-type f16|q8_0] [--no-flash-attn] --ctx N ...
    python -m ellm.bench.worker bandwidth --threads T

Prints one JSON object: prefill seconds for `ctx` prompt tokens, decode tokens/s per repeat (each repeat
truncates back to `ctx`, runs `warmup` untimed steps, then `gen` timed steps), and the ISA path that ran.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def real_tokens(tokenizer_encode, n: int) -> list[int]:
    """n tokens of real English text: the Apache License shipped with apache-tvm, repeated."""
    import tvm

    text = (Path(tvm.__file__).parent / "LICENSE").read_text()
    ids: list[int] = []
    one = tokenizer_encode(text)
    while len(ids) < n:
        ids += one
    return ids[:n]


def decode_rates(eng, logits, ctx: int, gen: int, warmup: int, repeat: int) -> list[float]:
    """Greedy decode after a `ctx`-token prefill whose last `logits` are given; per repeat: truncate back to
    `ctx`, `warmup` untimed steps, then tokens/s over `gen` timed steps. `eng`: an Engine or a ParallelEngine."""
    import numpy as np

    rates = []
    for _ in range(repeat):
        eng.truncate(ctx)
        tok = int(np.argmax(logits))
        for _ in range(warmup):
            tok = int(np.argmax(eng.decode(tok)))
        t = time.perf_counter()
        for _ in range(gen):
            tok = int(np.argmax(eng.decode(tok)))
        rates.append(gen / (time.perf_counter() - t))
    return rates


def run_ellm(a) -> dict:
    import ellm

    from ellm.cli import attention_option, rope_scaling_option
    from ellm.numa.cli import numa_option
    from ellm.parallel.build import is_group

    if is_group(a.artifact):
        return run_group(a)
    eng = ellm.load(a.artifact, threads=a.threads, ctx_size=a.ctx + a.gen + a.warmup + 16, target=a.target,
                    rope_scaling=rope_scaling_option(a), attention=attention_option(a, a.artifact), numa=numa_option(a))
    ids = real_tokens(eng.tokenizer.encode, a.ctx)
    eng.prefill(ids[: min(256, a.ctx)])  # warm-up: page in weights and code
    eng.reset()
    t = time.perf_counter()
    logits = eng.prefill(ids)
    prefill_s = time.perf_counter() - t
    rates = decode_rates(eng, logits, a.ctx, a.gen, a.warmup, a.repeat)
    return {"prefill_s": prefill_s, "decode_tok_s": rates, "target": eng.target, "isa": eng.artifact.target["isa"],
            "numa": eng.placement.summary()}


def run_group(a) -> dict:
    """A tensor-parallel group (ellm.parallel): the same measurement, plus what its collectives moved per decode
    step (rank 0's view). `threads`: CPUs for all ranks together, the first ones this process may use."""
    from ellm.numa.topology import allowed_cpus
    from ellm.parallel.engine import ParallelEngine

    eng = ParallelEngine(a.artifact, ctx_size=a.ctx + a.gen + a.warmup + 16, cpus=sorted(allowed_cpus())[: a.threads],
                         transport=a.transport)
    try:
        ids = real_tokens(eng.tokenizer.encode, a.ctx)
        eng.prefill(ids[: min(256, a.ctx)])
        eng.truncate(0)
        t = time.perf_counter()
        logits = eng.prefill(ids)
        prefill_s = time.perf_counter() - t
        before = eng.traffic()
        rates = decode_rates(eng, logits, a.ctx, a.gen, a.warmup, a.repeat)
        per = eng.traffic().since(before).per(a.repeat * (a.warmup + a.gen))
    finally:
        eng.close()
    return {"prefill_s": prefill_s, "decode_tok_s": rates, "ranks": eng.world, "cpus": [list(c) for c in eng.cpus],
            "transport": eng.transport, "collectives_per_token": per}


def run_llama_cpp(a) -> dict:
    import numpy as np

    if a.llama_path:  # a build in eLLM's cache (bench/llama_cpp.py), before any installed one
        sys.path.insert(0, a.llama_path)
    import llama_cpp
    from llama_cpp import Llama

    from ellm.bench.llama_cpp import isa_of

    from ellm.compiler.gguf_file import GGUFFile
    from ellm.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(a.model))  # the same token ids eLLM runs
    n_ctx = a.ctx + a.gen + a.warmup + 16
    rope = {}
    if a.rope_scaling in ("linear", "yarn"):  # llama.cpp's own RoPE scaling, as eLLM runs it
        import llama_cpp

        kind = llama_cpp.LLAMA_ROPE_SCALING_TYPE_YARN if a.rope_scaling == "yarn" else llama_cpp.LLAMA_ROPE_SCALING_TYPE_LINEAR
        rope = {"rope_scaling_type": kind, "rope_freq_scale": 1.0 / a.rope_scale}
    kv = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}[a.kv_type]
    llm = Llama(
        a.model, n_ctx=n_ctx, n_threads=a.threads, n_threads_batch=a.threads, n_batch=512,
        flash_attn=a.flash_attn, type_k=kv, type_v=kv, verbose=False, **rope,
    )
    n_vocab = llm.n_vocab()

    def argmax_last() -> int:
        return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(n_vocab,))))

    ids = real_tokens(tok.encode, a.ctx)
    llm.eval(ids[: min(256, a.ctx)])
    llm.reset()
    t = time.perf_counter()
    llm.eval(ids)
    prefill_s = time.perf_counter() - t
    first = argmax_last()
    rates = []
    for _ in range(a.repeat):
        llm.n_tokens = a.ctx  # eval() removes cache entries past n_tokens first
        t_ = first
        for _ in range(a.warmup):
            llm.eval([t_])
            t_ = argmax_last()
        t = time.perf_counter()
        for _ in range(a.gen):
            llm.eval([t_])
            t_ = argmax_last()
        rates.append(a.gen / (time.perf_counter() - t))
    info = llama_cpp.llama_print_system_info().decode()
    return {"prefill_s": prefill_s, "decode_tok_s": rates, "isa": isa_of(info), "system_info": info.strip(),
            "llama_cpp_python": llama_cpp.__version__}


def run_bandwidth(a) -> dict:
    from .bandwidth import measure_read_bandwidth

    bw = measure_read_bandwidth(a.threads)
    return {"gb_s": bw.gb_s_median, "gb_s_min": bw.gb_s_min, "gb_s_max": bw.gb_s_max}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("system", choices=["ellm", "llama.cpp", "bandwidth"])
    ap.add_argument("--model")
    ap.add_argument("--artifact")
    ap.add_argument("--ctx", type=int, default=0)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--target", help="eLLM: run this target of the artifact")
    ap.add_argument("--transport", choices=["shm", "tcp"], default="shm",
                    help="eLLM, a tensor-parallel group: the collective's transport")
    ap.add_argument("--llama-path", help="llama.cpp: directory of the llama_cpp build to import")
    ap.add_argument("--kv-type", choices=["f16", "q8_0"], default="f16", help="llama.cpp: KV cache type")
    ap.add_argument("--no-flash-attn", dest="flash_attn", action="store_false")
    from ellm.cli import add_attention_args, add_rope_scaling_args

    from ellm.numa.cli import add_numa_args

    add_rope_scaling_args(ap)
    add_attention_args(ap)
    add_numa_args(ap)
    a = ap.parse_args()
    out = {"ellm": run_ellm, "llama.cpp": run_llama_cpp, "bandwidth": run_bandwidth}[a.system](a)
    out.update(system=a.system, ctx=a.ctx, threads=a.threads)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
