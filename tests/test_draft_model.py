"""The draft-model drafters on the real model: a self-draft compiled from the same GGUF (its first layers
and head), greedy output unchanged by model and cascade drafts (8K with sparse attention included),
speculative sampling with the draft's own distribution, and refusals of drafts that cannot serve."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from conftest import THREADS
from ellm.speculative import SpeculativeConfig

# 20 of SmolLM2's 30 layers agree with the model on ~1 in 5 greedy tokens: enough accepted and rejected
# drafts to exercise both, and a fixed chain verifies every draft whatever the controller would choose
DRAFT_LAYERS = 20


@pytest.fixture(scope="module")
def draft(tmp_path_factory, model_path):
    from ellm.compiler.build import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("draft") / "self-draft"
    compile_model(model_path, out, CompileOptions(draft_layers=DRAFT_LAYERS))
    return out


def _model(draft, kind="model", adaptive=False) -> SpeculativeConfig:
    return SpeculativeConfig(chain=8, draft=kind, draft_model=str(draft), adaptive=adaptive)


def test_a_self_draft_keeps_the_first_layers_and_the_head(draft):
    from ellm.runtime.artifact import Artifact

    art = Artifact.open(draft)
    assert art.config.n_layers == DRAFT_LAYERS and art.manifest["draft"] == {"layers": DRAFT_LAYERS, "of": 30}
    names = {p["name"] for p in art.manifest["params"]}
    assert any(n.startswith(f"blk.{DRAFT_LAYERS - 1}.") for n in names)
    assert not any(n.startswith(f"blk.{DRAFT_LAYERS}.") for n in names)
    assert art.manifest["precision"]["origin"] == "quant-level 2"  # a draft is worth what it saves


def test_greedy_identity_with_model_and_cascade_drafts(engine, real_ids, draft):
    tok = engine.tokenizer
    prompts = [
        real_ids[:300] + real_ids[:40],
        tok.encode(tok.apply_chat_template([{"role": "user", "content": "Write a short poem about the sea."}])),
    ]
    for ids in prompts:
        plain = engine.generate(ids, 64, cache_reuse=False)
        for kind in ("model", "cascade"):
            assert engine.generate(ids, 64, speculative=_model(draft, kind), cache_reuse=False) == plain, kind
            st = engine.stats
            assert st.verify_steps > 0 and st.draft_s > 0
        assert engine.generate(ids, 64, speculative=_model(draft, adaptive=True), cache_reuse=False) == plain


def test_the_draft_model_rejects_and_accepts(engine, real_ids, draft):
    ids = real_ids[:300]
    engine.generate(ids, 48, speculative=_model(draft), cache_reuse=False)
    st = engine.stats
    assert 0 < st.accepted < st.drafted  # some drafts pass, some are rolled back (in both caches)


def test_greedy_identity_with_a_draft_model_at_8k_with_sparse_attention(artifact, real_text, draft):
    import ellm

    eng = ellm.load(artifact, threads=THREADS, ctx_size=8192)
    tok = eng.tokenizer
    ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": (real_text + "\n") * 3
                                               + "\nQuote section 4 of the license above, word for word."}]))
    assert 7000 < len(ids) < 8000 and eng.attention.mode == "sparse"
    plain = eng.generate(ids, 64, cache_reuse=False)
    assert eng.generate(ids, 64, speculative=_model(draft, "cascade"), cache_reuse=False) == plain
    assert eng.generate(ids, 64, speculative=_model(draft), cache_reuse=False) == plain
    assert eng.stats.verify_steps > 5
    # the draft's cache follows the conversation: the next turn's prompt extends this one, and the draft
    # reads only what is new
    drafter_engine = eng.draft_engine(str(draft))
    before = drafter_engine.n_cached
    assert before >= len(ids)
    eng.generate(ids + plain + ids[-5:], 8, speculative=_model(draft))
    assert drafter_engine.n_cached >= before


def test_sampling_with_the_drafts_distribution_preserves_the_models(engine, real_ids, draft):
    """Leviathan/Chen with a real q: the drafted token is drawn from the draft model's distribution, and
    the first token a verification emits, over 2,000 draws, follows the target's decode step."""
    from test_speculative import _chi2_ok

    from ellm.speculative.accept import accept_sampled, probabilities

    d = engine.draft_engine(str(draft))
    rng = np.random.default_rng(1)
    checked = 0
    for n in range(40, 400, 7):
        ids = real_ids[:n]
        d.reset()
        q = probabilities(d.prefill(ids), 1.0)
        engine.reset()
        engine.prefill(ids[:-1])
        p_row = engine.decode(ids[-1]).copy()
        p = probabilities(p_row, 1.0)
        if not 0.2 < float(np.abs(p - q).sum()) / 2 < 0.8:
            continue  # positions where drafts are both accepted and rejected, often
        checked += 1
        rows = np.stack([p_row, p_row])  # the second row only matters after the first token is accepted
        counts = np.zeros(p.size)
        for _ in range(2000):
            x = int(rng.choice(q.size, p=q))
            acc, nxt = accept_sampled(probabilities(rows, 1.0), [x], rng, q[None, :])
            counts[x if acc else nxt] += 1
        assert _chi2_ok(counts, p), n
        if checked == 3:
            break
    assert checked == 3


def test_sampled_speculation_with_a_draft_model_is_seeded(engine, real_ids, draft):
    ids = real_ids[:200]
    a = engine.generate(ids, 40, temperature=0.8, seed=5, speculative=_model(draft))
    b = engine.generate(ids, 40, temperature=0.8, seed=5, speculative=_model(draft))
    assert a == b and engine.stats.verify_steps > 0


def _run(artifact, *args, cache):
    env = dict(os.environ, ELLM_CACHE=str(cache))
    return subprocess.run([sys.executable, "-m", "ellm", "run", str(artifact), "-p", "Hello", "-n", "4",
                           "--threads", str(THREADS), *args], capture_output=True, text=True, env=env)


def test_cli_runs_the_model_drafter_and_reports_it(artifact, draft, tmp_path):
    r = _run(artifact, "--json", "--speculative-chain", "4", "--draft", "model", "--draft-model", str(draft),
             "--fixed-chain", cache=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["verify_steps"] >= 1 and "accept_rate" in out


def test_a_draft_with_another_vocabulary_is_refused_with_one_line(artifact, tmp_path):
    """A GGUF draft is compiled into the cache, then refused: its 320 tokens are not SmolLM2's."""
    from synthetic import write_model

    tiny = write_model(tmp_path / "tiny.gguf", n_layers=1)
    r = _run(artifact, "--speculative-chain", "4", "--draft", "model", "--draft-model", str(tiny), cache=tmp_path)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert "vocabulary" in lines[-1] and "Traceback" not in r.stderr
    r = _run(artifact, "--speculative-chain", "4", "--draft", "model", cache=tmp_path)
    assert r.returncode == 2 and "needs --draft-model" in r.stderr and "Traceback" not in r.stderr


def test_self_draft_options_are_checked_before_any_work(model_path, tmp_path):
    from ellm.compiler.build import CompileOptions, compile_model
    from ellm.errors import EllmError

    with pytest.raises(EllmError, match="between 1 and 29"):
        compile_model(model_path, tmp_path / "a", CompileOptions(draft_layers=30))
    with pytest.raises(EllmError, match="precision recipe"):
        CompileOptions(draft_layers=4, precision="auto")
    assert not (tmp_path / "a").exists()
