"""One system's run of the speculation task set at one prompt length, in its own process: every task
without and with speculation (each drafter in turn), alternating, the generated tokens and their decode rate.

    python -m ellm.bench.spec_worker ellm --artifact DIR --ctx N --gen G --chain K --rounds R --threads T \
        [--draft ngram,model,cascade --draft-model DIR]
    python -m ellm.bench.spec_worker llama.cpp --model GGUF --llama-path DIR --ctx N --gen G --rounds R --threads T

Both greedy, both stop at the model's end-of-generation tokens. The decode rate counts the tokens after the
first over the time from the first to the last (prefill and time to first token excluded). Prints one JSON
object.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _prompts(names: str | None, tokenizer, ctx: int) -> list[tuple]:
    """(task, prompt ids) of every task (`names`, default all) at about `ctx` tokens (more where a task's
    material and request alone are longer)."""
    from .spec_tasks import TASKS, task

    return [(t, t.prompt(tokenizer, ctx)) for t in ([task(n) for n in names.split(",")] if names else TASKS)]


def _context(prompts, a) -> int:
    return max(len(ids) for _, ids in prompts) + a.gen + 64


def _run_tasks(prompts, rounds: int, start, modes: list[str], generate) -> list[dict]:
    """Per task: `start(ids)` (a new prompt), then `rounds` rounds of generation in every mode ("plain" first,
    then each drafter), alternating; `generate(ids, mode)`: the tokens and the run's record."""
    rows = []
    for t, ids in prompts:
        start(ids)
        runs: dict[str, list] = {m: [] for m in modes}
        outs = {}
        for _ in range(rounds):
            for mode in modes:
                outs[mode], record = generate(ids, mode)
                runs[mode].append(record)
        rows.append({"task": t.name, "grounded": t.grounded, "prompt_tokens": len(ids), "runs": runs,
                     "identical": {m: outs[m] == outs["plain"] for m in modes[1:]}})
    return rows


def run_ellm(a) -> dict:
    import ellm
    from ellm.runtime.artifact import Artifact
    from ellm.speculative import SpeculativeConfig

    prompts = _prompts(a.tasks, Artifact.open(a.artifact, verify=False, check_cpu=False).tokenizer(), a.ctx)
    eng = ellm.load(a.artifact, threads=a.threads, ctx_size=_context(prompts, a))
    drafters = a.draft.split(",")
    spec = {d: SpeculativeConfig(chain=a.chain, draft=d, draft_model=a.draft_model if d != "ngram" else None)
            for d in drafters}

    def generate(ids, mode: str):
        out = eng.generate(ids, a.gen, speculative=spec.get(mode), cache_reuse=False)
        st = eng.stats
        return out, {"tok_s": st.decode_tok_s, "tokens": len(out), "verify_steps": st.verify_steps,
                     "decode_steps": st.decode_steps, "drafted": st.drafted, "accepted": st.accepted,
                     "draft_s": st.draft_s}

    # the prompt is prefilled by the first call; later ones reuse its KV exactly
    rows = _run_tasks(prompts, a.rounds, lambda ids: None, ["plain", *drafters], generate)
    return {"tasks": rows, "target": eng.target, "chain": a.chain, "draft_model": a.draft_model}


def run_llama_cpp(a) -> dict:
    if a.llama_path:
        sys.path.insert(0, a.llama_path)
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    from ellm.compiler.gguf_file import GGUFFile
    from ellm.runtime.tokenizer import Tokenizer

    tok = Tokenizer.from_gguf(GGUFFile(a.model))  # the same token ids eLLM runs
    kv = {"f16": llama_cpp.GGML_TYPE_F16, "q8_0": llama_cpp.GGML_TYPE_Q8_0}[a.kv_type]
    lookup = LlamaPromptLookupDecoding(num_pred_tokens=a.lookup_tokens)
    prompts = _prompts(a.tasks, tok, a.ctx)
    # verification needs every row's logits: a draft model at construction and logits_all (which sizes the buffer)
    llm = Llama(a.model, n_ctx=_context(prompts, a), n_threads=a.threads, n_threads_batch=a.threads, n_batch=512,
                flash_attn=a.flash_attn, type_k=kv, type_v=kv, verbose=False, draft_model=lookup, logits_all=True)
    stop = set(tok.info.eog_ids)

    def generate(ids, mode: str):
        llm.draft_model = lookup if mode == "lookup" else None
        out: list[int] = []
        t_first = t_last = 0.0
        for x in llm.generate(ids, temp=0.0, repeat_penalty=1.0):  # reuses the cached prompt but its last token
            t_last = time.perf_counter()
            if not out:
                t_first = t_last
            out.append(int(x))
            if x in stop or len(out) >= a.gen:
                break
        rate = (len(out) - 1) / (t_last - t_first) if len(out) > 1 else float("nan")
        return out, {"tok_s": rate, "tokens": len(out)}

    def start(ids):
        llm.reset()
        llm.eval(ids)  # the prompt once

    rows = _run_tasks(prompts, a.rounds, start, ["plain", "lookup"], generate)
    return {"tasks": rows, "llama_cpp_python": llama_cpp.__version__, "lookup_tokens": a.lookup_tokens,
            "kv_type": a.kv_type, "flash_attn": a.flash_attn}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("system", choices=["ellm", "llama.cpp"])
    ap.add_argument("--artifact")
    ap.add_argument("--model")
    ap.add_argument("--llama-path")
    ap.add_argument("--ctx", type=int, required=True)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--chain", type=int, default=16)
    ap.add_argument("--draft", default="ngram", help="eLLM: comma-separated drafters, each run in turn")
    ap.add_argument("--draft-model", help="eLLM: the draft model of the model and cascade drafters")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--tasks", help="comma-separated task names (default: all)")
    ap.add_argument("--kv-type", choices=["f16", "q8_0"], default="f16")
    ap.add_argument("--no-flash-attn", dest="flash_attn", action="store_false")
    ap.add_argument("--lookup-tokens", type=int, default=10, help="llama.cpp: LlamaPromptLookupDecoding num_pred_tokens")
    a = ap.parse_args()
    out = (run_ellm if a.system == "ellm" else run_llama_cpp)(a)
    out.update(system=a.system, ctx=a.ctx, threads=a.threads, gen=a.gen, rounds=a.rounds)
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
