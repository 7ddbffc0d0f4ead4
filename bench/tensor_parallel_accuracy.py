"""How far a tensor-parallel group's logits are from the single process's, and both from exact: an independent
float64 NumPy model of the same GGUF (tests/reference.py), over greedy decode steps teacher-forced on the single
run's tokens. Compile both with float activations (`--activations f32 --precision source --kv-type f16`) to
see the order of float additions alone; the reference rounds K and V through float16 as the cache does.
Emits JSON.

    python bench/tensor_parallel_accuracy.py SINGLE GROUP GGUF [--steps 64] [--prompt TEXT] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from ellm.bench.report import emit_report
from ellm.parallel.engine import ParallelEngine
from ellm.runtime.engine import Engine

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from reference import NumpyLlama  # noqa: E402


def distance(a: list[np.ndarray], b: list[np.ndarray]) -> dict:
    d = [float(np.abs(x - y).max()) for x, y in zip(a, b)]
    return {"max_abs": max(d), "mean_max_abs": float(np.mean(d)),
            "argmax_agree": int(sum(np.argmax(x) == np.argmax(y) for x, y in zip(a, b)))}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("single")
    p.add_argument("group")
    p.add_argument("gguf")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--prompt", default="The capital of France is Paris. The capital of Germany is")
    p.add_argument("--out")
    a = p.parse_args()
    eng = Engine.load(a.single, threads=1)
    ids = eng.tokenizer.encode(a.prompt)
    single: list[np.ndarray] = []
    toks = eng.generate(ids, a.steps, stop_at_eog=False,
                        on_logits=lambda t, logits: single.append(np.array(logits, dtype=np.float64)))
    group = ParallelEngine(a.group)
    try:
        got = [np.array(group.prefill(ids), dtype=np.float64)]
        got += [np.array(group.decode(t), dtype=np.float64) for t in toks[:-1]]
    finally:
        group.close()
    kv = "float16" if eng.artifact.manifest["kv_cache"]["k"][0] == "f16" else None
    exact = list(NumpyLlama(a.gguf, kv_dtype=kv).forward(ids + toks[:-1])[len(ids) - 1:])
    return emit_report({"steps": len(single), "prompt_tokens": len(ids), "reference_kv": kv or "float64",
                        "logit_absmax": float(max(np.abs(x).max() for x in exact)),
                        "single_vs_float64": distance(single, exact), "group_vs_float64": distance(got, exact),
                        "group_vs_single": distance(got, single)}, a.out)


if __name__ == "__main__":
    sys.exit(main())
