"""`ellm synth`: llama GGUF files of real shapes with random weights and llama.cpp's type mixes."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf import GGUFReader
from gguf.quants import dequantize

from ellm.synth import SHAPES, TYPE_MIXES, ModelShape, tensor_plan, use_more_bits, write_synthetic
from ellm.synth.blocks import row_bytes

TINY = ModelShape("tiny", n_layers=8, d_model=256, n_heads=4, n_kv_heads=2, head_dim=64, d_ff=512, vocab=1024, tied=False)


def _bytes(shape, mix) -> int:
    return sum(t.rows * (4 * t.cols if t.qtype is G.F32 else row_bytes(t.qtype, t.cols)) for t in tensor_plan(shape, mix))


def test_use_more_bits_is_llama_cpps():
    """llama-quant.cpp: i < n/8 || i >= 7n/8 || (i - n/8) % 3 == 2."""
    assert [i for i in range(32) if use_more_bits(i, 32)] == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(16) if use_more_bits(i, 16)] == [0, 1, 4, 7, 10, 13, 14, 15]


@pytest.mark.parametrize("name,published", [("llama-1b", 0.81e9), ("llama-3b", 2.02e9), ("llama-8b", 4.92e9)])
def test_q4_k_m_sizes_match_published_files(name, published):
    """Tensor bytes against the published Q4_K_M files of Llama 3.2 1B/3B Instruct and Llama 3.1 8B Instruct
    (0.81, 2.02 and 4.92 GB as listed), within 1.5%: those also carry a tokenizer of a few MB and Llama 3's
    rope_freqs tensor."""
    assert abs(_bytes(SHAPES[name], TYPE_MIXES["q4_k_m"]) - published) <= 0.015 * published


def test_q4_k_m_types_per_role():
    plan = {t.name: t.qtype for t in tensor_plan(SHAPES["llama-8b"], TYPE_MIXES["q4_k_m"])}
    assert plan["output.weight"] is G.Q6_K and plan["token_embd.weight"] is G.Q4_K  # untied: the embedding stays Q4_K
    for i in range(32):
        more = G.Q6_K if use_more_bits(i, 32) else G.Q4_K
        assert plan[f"blk.{i}.attn_v.weight"] is more and plan[f"blk.{i}.ffn_down.weight"] is more
        assert plan[f"blk.{i}.attn_q.weight"] is G.Q4_K and plan[f"blk.{i}.ffn_up.weight"] is G.Q4_K
    tied = {t.name: t.qtype for t in tensor_plan(SHAPES["llama-1b"], TYPE_MIXES["q4_k_m"])}
    assert tied["token_embd.weight"] is G.Q6_K and "output.weight" not in tied  # tied: the head's type


@pytest.mark.parametrize("mix", ["q4_k_m", "q4_0", "q8_0"])
def test_written_file_reads_back_with_weights_like_trained_ones(tmp_path, mix):
    path = write_synthetic(tmp_path / "m.gguf", TINY, TYPE_MIXES[mix], seed=1)
    r = GGUFReader(str(path))
    tensors = {t.name: t for t in r.tensors}
    plan = tensor_plan(TINY, TYPE_MIXES[mix])
    assert list(tensors) == [t.name for t in plan]
    for t in plan:
        rt = tensors[t.name]
        assert G(rt.tensor_type) is t.qtype
        w = rt.data if t.qtype is G.F32 else dequantize(rt.data, t.qtype).reshape(t.rows, t.cols)
        assert np.isfinite(w).all()
        if t.qtype is not G.F32:
            assert 0.012 <= w.std() <= 0.035, (t.name, w.std())
    assert not list(tmp_path.glob(".*partial"))


def test_ellm_reads_the_model_and_its_tokenizer(tmp_path):
    from ellm.compiler.gguf_file import GGUFFile
    from ellm.config import ModelConfig
    from ellm.runtime.tokenizer import Tokenizer

    path = write_synthetic(tmp_path / "m.gguf", TINY, TYPE_MIXES["q4_k_m"])
    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (8, 4, 2, 64)
    tok = Tokenizer.from_gguf(gf)
    text = "The quick brown fox jumps over the lazy dog, 42 times."
    ids = tok.encode(text)
    assert tok.decode(ids).endswith(text) and len(ids) < len(text)  # merges apply; BOS (added) decodes to nothing


def test_refuses_to_overwrite(tmp_path):
    from ellm.errors import EllmError

    (tmp_path / "m.gguf").write_bytes(b"x")
    with pytest.raises(EllmError, match="exists"):
        write_synthetic(tmp_path / "m.gguf", TINY, TYPE_MIXES["q4_0"])
