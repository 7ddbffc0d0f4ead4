"""Quantised KV caches on the real model: quality against the float16 cache, and exact truncation and
cache reuse even when the float16 ring no longer holds the blocks a truncation needs."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import THREADS
from ellm.eval.ppl import perplexity
from ellm.eval.texts import opticks


@pytest.fixture(scope="module", params=["q8_0", "q4_0", "auto"])
def quant_engine(request, tmp_path_factory, model_path):
    import ellm
    from ellm.compiler.build import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("kvq") / request.param
    # 16-bit activations throughout, as the float16-cache engine it is compared with: the KV precision alone.
    # auto: the rule-based per-layer plan (q4, q8 keys in the first layers: stores of two classes), not the
    # measured one, whose sensitivity analysis of the real model takes ~10 min on 2 Zen 3 cores (the cold
    # demo of `make test-slow` compiles that; tests/test_precision_plan.py checks it on small models)
    options = CompileOptions(cache_type_k=request.param, cache_type_v=request.param, activations="int16",
                             precision="source" if request.param == "auto" else None)
    compile_model(model_path, out, options)
    return request.param, ellm.load(out, threads=THREADS, ctx_size=2048)


def test_verification_rows_equal_decode_steps_with_block_selection(quant_engine, opticks_ids):
    """Verification (speculative chains) on quantised stores, selecting 4 of ~20 candidate blocks per query
    (sparse reads at 2K), with widening: every row equals the decode step at its position bit for bit."""
    import ellm
    from ellm.kv.attention import AttentionConfig

    _, eng = quant_engine
    sparse = ellm.load(eng.artifact.path, threads=THREADS, ctx_size=2048,
                       attention=AttentionConfig(topk=4, widen=4, margin=2.0))
    n, chain = 1900, opticks_ids[1900:1932]
    sparse.prefill(opticks_ids[:n])
    decoded = np.stack([sparse.decode(t).copy() for t in chain])
    sparse.truncate(n)
    np.testing.assert_array_equal(sparse.verify(chain), decoded)


@pytest.fixture(scope="module")
def opticks_ids(engine):
    return engine.tokenizer.encode(opticks().read_text()[:20000])


# measured at 2,047 tokens of Opticks: q8 KL 2e-5, perplexity -0.02%; q4 KL 0.0055, +0.11%
BOUNDS = {"q8_0": (2e-4, 0.003, 0.98), "q4_0": (0.02, 0.01, 0.93), "auto": (0.02, 0.01, 0.93)}  # mean KL, |ppl ratio - 1|, top-1


def test_quality_against_float16_cache(quant_engine, engine, opticks_ids):
    name, eng = quant_engine
    r = perplexity(eng, opticks_ids[:1200], reference=engine)
    kl, ppl, top1 = BOUNDS[name]
    assert r.kl_mean < kl and abs(r.ppl / r.ref_ppl - 1) < ppl and r.top1_agree > top1, r


def test_deep_truncation_recomputes_exactly(quant_engine, opticks_ids):
    _, eng = quant_engine
    a, b = opticks_ids[:300], opticks_ids[300:340]
    fresh = eng.logits(a + b)[len(a) :]
    eng.reset()
    eng.prefill(a)
    eng.prefill(opticks_ids[1000:1600])  # 600 more tokens: the ring has moved far past position 300
    assert not eng.restorable(len(a))
    eng.truncate(len(a))
    np.testing.assert_array_equal(eng.prefill(b, all_logits=True), fresh)
    # a shallow truncation keeps the state
    eng.prefill(opticks_ids[2000:2010])
    assert eng.restorable(len(a) + len(b))
    eng.truncate(len(a) + len(b))
    np.testing.assert_array_equal(eng.prefill(opticks_ids[340:350], all_logits=True),
                                  eng.logits(opticks_ids[:350])[340:])


def test_generate_reuse_is_exact(quant_engine, opticks_ids):
    _, eng = quant_engine
    prompt = opticks_ids[:500]
    eng.reset()
    first = eng.generate(prompt, 20, stop_at_eog=False)
    again = eng.generate(prompt, 20, stop_at_eog=False)
    assert eng.stats.reused_tokens == len(prompt) - 1 and again == first
    eng.generate(opticks_ids[:100], 4)  # diverge early: beyond the ring, nothing is reused
    assert eng.stats.reused_tokens == 0
    assert eng.generate(prompt, 20, stop_at_eog=False) == first
