"""Every tensor type, both architectures and the unfused pipeline, end to end on tiny synthetic models."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from reference import NumpyLlama
from synthetic import write_model

import ellm
from ellm.compiler.build import CompileOptions, compile_model
from ellm.compiler.pipeline import optional_pass_names

TOL = 1e-3  # 16-bit activations and float32 vs float64 on 2 small layers with float32 KV
EXACT = CompileOptions(cache_type_k="f32", cache_type_v="f32", activations="int16")


def _check(tmp_path, name, options=EXACT, **model_kw):
    gguf_path = write_model(tmp_path / f"{name}.gguf", **model_kw)
    art = compile_model(gguf_path, tmp_path / name, options).path
    eng = ellm.load(art, threads=2)
    ids = list(np.random.default_rng(0).integers(0, eng.config.vocab_size, 40))
    got = eng.logits(ids)
    ref = NumpyLlama(gguf_path).forward(ids)
    assert np.abs(got - ref).max() <= TOL * max(1.0, np.abs(ref).max())
    return eng, ids, got


MIXES = {
    "k_quants": {"q": G.Q4_K, "k": G.Q4_K, "v": G.Q6_K, "o": G.Q4_K, "gate": G.Q4_K, "up": G.Q4_K, "down": G.Q6_K, "embd": G.Q6_K},
    "legacy": {"q": G.Q4_0, "k": G.Q4_0, "v": G.Q8_0, "o": G.Q8_0, "gate": G.Q4_0, "up": G.Q4_0, "down": G.Q8_0, "embd": G.Q4_0},
    "float": {"q": G.F16, "k": G.F16, "v": G.F16, "o": G.BF16, "gate": G.BF16, "up": G.BF16, "down": G.F32, "embd": G.F16},
}


@pytest.mark.parametrize("mix", list(MIXES))
def test_type_mixes(tmp_path, mix):
    _check(tmp_path, mix, types=MIXES[mix])


def test_qwen2_biases_and_neox_rope_untied_head(tmp_path):
    eng, *_ = _check(tmp_path, "qwen2", arch="qwen2", tied=False, types={"head": G.Q6_K})
    assert eng.config.attn_bias and eng.config.rope_neox and not eng.config.tied_embeddings


def test_unfused_pipeline_gives_the_same_logits(tmp_path):
    """Disabling every pass changes the kernels, not the answer."""
    gguf_path = write_model(tmp_path / "m.gguf", types=MIXES["k_quants"])
    ids = list(range(3, 40))
    fused = ellm.load(compile_model(gguf_path, tmp_path / "fused", EXACT).path, threads=2)
    plain_art = compile_model(gguf_path, tmp_path / "plain", replace(EXACT, disable_passes=tuple(optional_pass_names())))
    plain = ellm.load(plain_art.path, threads=2)
    assert plain.artifact.target["graph"]["ops"].get("rmsnorm") == 5
    a, b = fused.logits(ids), plain.logits(ids)
    assert np.abs(a - b).max() <= 1e-4 * np.abs(a).max()
    # and decode through the unfused single-token kernels agrees too
    plain.reset()
    plain.prefill(ids[:-1])
    assert np.abs(plain.decode(ids[-1]) - a[-1]).max() <= 1e-4 * np.abs(a).max()


def test_sentencepiece_tokenizer_model(tmp_path):
    eng, *_ = _check(tmp_path, "spm", tokenizer="llama")
    tok = eng.tokenizer
    ids = tok.encode("the thin")
    assert ids[0] == 1  # llama-style models add BOS by default
    assert tok.decode(ids[1:]) == "the thin"
    assert tok.decode(tok.encode("é", add_bos=False)) == "é"  # byte fallback
