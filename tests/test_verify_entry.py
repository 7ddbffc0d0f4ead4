"""The verification entry's kernels: rows computed as one-token steps, on a tiny synthetic model (golden
structure of the lowering, then bit equality of its rows with decode steps where the host runs them)."""

from __future__ import annotations

import numpy as np
import pytest
from synthetic import write_model

from ellm.compiler.build import CompileOptions, compile_model
from ellm.compiler.gguf_file import GGUFFile
from ellm.compiler.lower import ENTRIES, lower
from ellm.config import ModelConfig
from ellm.targets import get_preset

ZEN4 = get_preset("znver4")
VERIFY = [e for e in ENTRIES if e.steps]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("m") / "tiny.gguf")


def _graph(tiny, steps=None, chunks=None):
    """SmolLM2-like tiny graph for AVX-512; `steps`/`chunks`: activation precisions where they differ from auto's."""
    from dataclasses import replace

    from ellm.compiler.compile_target import pass_context
    from ellm.compiler.import_llama import import_llama
    from ellm.compiler.pipeline import run_pipeline

    gf = GGUFFile(tiny)
    ctx = pass_context(CompileOptions(), ZEN4)
    ctx = replace(ctx, activations=steps or ctx.activations, chunk_activations=chunks or ctx.chunk_activations)
    return run_pipeline(import_llama(gf, ModelConfig.from_gguf(gf)), ctx)


def test_verification_takes_the_one_token_steps_numerics_and_attention(tiny):
    """With 16-bit activations in one-token steps and 8-bit ones in chunks (as a precision plan may choose),
    verification rows take the steps' 16 bits, and decode's split-K attention rule (its rows must merge partial
    sums as decode does)."""
    kernels = lower(_graph(tiny, "int16", "int8"), ZEN4, entries=VERIFY).kernels
    matmuls = [k for k in kernels if k.req.weight_shape is not None and k.req.attr("act_bits") is not None]
    assert matmuls and {k.req.attr("act_bits") for k in matmuls} == {16}
    assert all(k.req.m is None for k in kernels)
    attention = [k for k in kernels if k.req.kind.value == "attention"]
    assert attention and {k.rule for k in attention} == {"attention_decode"}
    chunks = lower(_graph(tiny, "int16", "int8"), ZEN4, entries=[e for e in ENTRIES if e.name == "prefill"]).kernels
    assert {k.rule for k in chunks if k.req.kind.value == "attention"} == {"attention"}
    assert {k.req.attr("act_bits") for k in chunks if k.req.weight_shape is not None and k.req.m is None} - {None} == {8}


def test_verification_attention_takes_the_decode_kernels_tuned_knobs(tiny):
    """A tuning database that gives decode attention other split-K chunks gives them to verification too:
    with chunks of another size its rows would merge in another order and differ from decode."""
    def lookup(req, rule):
        return {"chunk_blocks": 2, "prefetch": 3} if rule == "attention_decode" and req.m == 1 else None

    kernels = lower(_graph(tiny), ZEN4, knob_lookup=lookup, entries=VERIFY).kernels
    attention = [k for k in kernels if k.rule == "attention_decode"]
    assert attention and all(k.knobs["chunk_blocks"] == 2 and k.knobs["prefetch"] == 3 for k in attention)


def test_tiny_model_verification_rows_equal_decode_steps(tiny, tmp_path):
    import ellm

    out = tmp_path / "a"
    compile_model(tiny, out, CompileOptions(target="x86-64-v3"))  # AVX2: runs on every host of this project
    eng = ellm.load(out, threads=2, ctx_size=512)
    rng = np.random.default_rng(0)
    ids = rng.integers(3, eng.config.vocab_size, 300).tolist()
    for n, k in ((1, 4), (120, 20), (250, 32)):
        eng.reset()
        eng.prefill(ids[:n])
        decoded = np.stack([eng.decode(t).copy() for t in ids[n : n + k]])
        eng.truncate(n)
        np.testing.assert_array_equal(eng.verify(ids[n : n + k]), decoded)
