"""Evaluations: pass-key prompts, perplexity and KL bookkeeping, and `ellm eval` end to end on the real model."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from ellm.eval.passkey import FILLER, NEEDLE, parse_answer, passkey_prompt
from ellm.eval.ppl import _log_softmax, perplexity
from ellm.eval.texts import opticks


def ellm(*args):
    return subprocess.run([sys.executable, "-m", "ellm", *map(str, args)], capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("length", [256, 1000, 3000])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_passkey_prompt_length_and_depth(engine, length, depth):
    tok = engine.tokenizer
    ids = passkey_prompt(tok.encode, length, depth, 48213)
    assert length - 40 <= len(ids) <= length
    text = tok.decode(ids)
    at = text.index(NEEDLE.format(key=48213))
    before, total = text[:at].count(FILLER), text.count(FILLER)
    assert total >= (length - 100) / 25  # the prompt is mostly filler
    assert abs(before / total - depth) <= 0.5 / total + 1e-9
    assert text.endswith("The pass key is")


def test_parse_answer():
    assert parse_answer(" 48213. Remember") == 48213
    assert parse_answer(" unknown") is None


def test_log_softmax_and_kl_of_identical_engines_is_zero(engine, artifact):
    import ellm

    x = np.array([[0.0, 1.0, 2.0], [5.0, 5.0, 5.0]], np.float32)
    np.testing.assert_allclose(np.exp(_log_softmax(x)).sum(axis=1), 1.0)
    np.testing.assert_allclose(_log_softmax(x)[1], np.log(1 / 3))
    ids = engine.tokenizer.encode(opticks().read_text()[:4000])[:300]
    with pytest.raises(ValueError, match="separate"):
        perplexity(engine, ids, reference=engine)
    twin = ellm.load(artifact, threads=2, ctx_size=512)  # same artifact, its own KV cache
    r = perplexity(engine, ids, reference=twin, chunk=128)
    assert r.tokens == len(ids) - 1
    assert r.kl_mean == pytest.approx(0.0, abs=1e-9) and r.top1_agree == 1.0
    assert r.ref_nll == pytest.approx(r.nll)
    assert 1.5 < r.ppl < 200  # real English prose under a real model


def test_perplexity_is_chunk_invariant_and_matches_logits(engine):
    ids = engine.tokenizer.encode(opticks().read_text()[:3000])[:200]
    a = perplexity(engine, ids, chunk=64)
    b = perplexity(engine, ids, chunk=200)
    assert a.nll == pytest.approx(b.nll, rel=1e-6)
    lp = _log_softmax(engine.logits(ids))
    want = -np.mean(lp[np.arange(len(ids) - 1), ids[1:]])
    assert a.nll == pytest.approx(want, rel=1e-6)
    assert math.isclose(a.ppl, math.exp(a.nll))


def test_eval_passkey_cli_finds_the_key(artifact):
    """The dense path retrieves the key at 1K tokens (a check that every configuration scoring zero would fail)."""
    p = ellm("eval", "passkey", artifact, "--lengths", "1024", "--depths", "0.2,0.8", "--json", "--threads", "2")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)["this"]
    assert out["lengths"] == [1024] and len(out["answers"]) == 2
    assert out["accuracy_per_length"][0] == 1.0, out["answers"]


def test_eval_ppl_cli_against_dense(artifact_f32_int16, tmp_path):
    """With --against dense on an F32-KV artifact, the F16-KV reference is compiled and compared."""
    import os

    art32 = artifact_f32_int16
    env = dict(os.environ, ELLM_CACHE=str(tmp_path / "cache"))
    p = subprocess.run([sys.executable, "-m", "ellm", "eval", "ppl", art32, opticks(), "--ctx", "600", "--against", "dense",
                        "--json"], capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["tokens"] == 599 and "K f16, V f16" in out["reference_config"] and "K f32, V f32" in out["config"]
    assert out["reference_config"].startswith("attention dense")
    # float16 rounding of K/V barely moves the distributions (the reference has the artifact's 16-bit activations)
    assert 0 < out["kl_mean"] < 1e-3
    assert abs(out["ppl"] / out["ref_ppl"] - 1) < 0.01


def test_eval_errors(artifact, tmp_path):
    p = ellm("eval", "ppl", artifact, tmp_path / "missing.txt")
    assert p.returncode == 2 and "cannot read" in p.stderr and "Traceback" not in p.stderr
    short = tmp_path / "short.txt"
    short.write_text("Too short.")
    p = ellm("eval", "ppl", artifact, short, "--ctx", "100")
    assert p.returncode == 2 and "only" in p.stderr
    p = ellm("eval", "passkey", artifact, "--depths", "1.5")
    assert p.returncode == 2 and "depths" in p.stderr
