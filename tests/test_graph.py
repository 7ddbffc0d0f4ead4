"""The graph IR: import, each fusion pass, invariants, and `ellm inspect`."""

from __future__ import annotations

import pytest
from gguf import GGMLQuantizationType as G
from synthetic import write_model

from ellm.compiler.gguf_file import GGUFFile
from ellm.compiler.graph import Use
from ellm.compiler.import_llama import import_llama
from ellm.compiler.passes import fuse_residual_add, fuse_rmsnorm_matmul, fuse_rope_kv_append, fuse_sibling_matmuls
from ellm.compiler.pass_context import PassContext
from ellm.compiler.pipeline import run_pipeline
from ellm.config import ModelConfig
from ellm.targets import get_preset

CTX = PassContext(get_preset("znver4"), "int16")


@pytest.fixture(scope="module")
def smol(model_path):
    gf = GGUFFile(model_path)
    return import_llama(gf, ModelConfig.from_gguf(gf))


def test_import_has_one_node_per_reference_op(smol):
    assert dict(smol.op_counts()) == {
        "embedding": 1, "rmsnorm": 61, "matmul": 210, "rope": 60, "kv_append": 30,
        "attention": 30, "add": 60, "silu_mul": 30, "lm_head": 1,
    }
    head = smol.op("lm_head")
    assert head.weight.name == "token_embd.weight"  # tied
    assert head.out.shape == ("T", 49152)
    smol.check()


def test_fuse_sibling_matmuls(smol):
    g = fuse_sibling_matmuls(smol, CTX)
    qkv = g.op("blk.0.attn_q+attn_k+attn_v")
    assert qkv.weight.rows == 576 + 192 + 192 and qkv.weight.sources == (
        "blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.attn_v.weight",
    )
    assert g.op("blk.0.rope_k").inputs == (Use("blk.0.attn_q+attn_k+attn_v", (576, 768)),)
    assert "blk.0.ffn_gate+ffn_up" in g.g and g.op_counts()["matmul"] == 30 * 4
    g.check()


def test_sibling_fusion_respects_weight_types(tmp_path):
    path = write_model(tmp_path / "m.gguf", types={"v": G.Q6_K})
    gf = GGUFFile(path)
    g = fuse_sibling_matmuls(import_llama(gf, ModelConfig.from_gguf(gf)), CTX)
    assert "blk.0.attn_q+attn_k" in g.g and "blk.0.attn_v" in g.g  # V has another type: left alone


def test_fuse_rmsnorm_matmul(smol):
    g = fuse_rmsnorm_matmul(fuse_sibling_matmuls(smol, CTX), CTX)
    assert "rmsnorm" not in g.op_counts()
    qkv = g.op("blk.0.attn_q+attn_k+attn_v")
    assert qkv.vector("norm").name == "blk.0.attn_norm.weight" and qkv.attr("norm_eps") > 0
    assert g.op("lm_head").vector("norm").name == "output_norm.weight"


def test_fuse_residual_add(smol):
    g = fuse_residual_add(smol, CTX)
    assert "add" not in g.op_counts()
    o = g.op("blk.0.attn_output")
    assert o.attr("residual") and o.inputs == (Use("blk.0.attention"), Use("embed"))


def test_fuse_rope_kv_append_needs_fused_qkv(smol):
    assert "rope_kv_append" not in fuse_rope_kv_append(smol, CTX).op_counts()
    g = fuse_rope_kv_append(fuse_sibling_matmuls(smol, CTX), CTX)
    counts = g.op_counts()
    assert counts["rope_kv_append"] == 30 and "rope" not in counts and "kv_append" not in counts
    # the cache is threaded through the layers in order
    assert g.op("blk.1.rope_kv_append").inputs[0] == Use("blk.0.rope_kv_append", index=1)
    g.check()


def test_pipeline_result(smol):
    g = run_pipeline(smol, CTX)
    assert dict(g.op_counts()) == {"embedding": 1, "attention_input": 30, "attention": 30, "matmul": 90, "silu_mul": 30, "lm_head": 1}
    assert sum(w.nbytes for w in g.weights()) == sum(w.nbytes for w in smol.weights())


def test_opt_in_ffn_fusion(smol):
    g = run_pipeline(smol, CTX, enable=["fuse_ffn"])
    assert dict(g.op_counts()) == {"embedding": 1, "attention_input": 30, "attention": 30, "matmul": 30, "ffn": 30, "lm_head": 1}
    ffn = g.op("blk.0.ffn")
    assert [w.name for w in ffn.weights] == ["blk.0.ffn_gate+ffn_up.weight", "blk.0.ffn_down.weight"]
    assert all(w.layout == "tile16" for w in ffn.weights) and ffn.attr("d_ff") == 1536


def test_attention_input_fusion(smol):
    g = run_pipeline(smol, CTX)
    ai = g.op("blk.0.attention_input")
    assert ai.inputs[0].src == "kv_cache" and ai.weight.name == "blk.0.attn_q+attn_k+attn_v.weight"
    assert g.op("blk.0.attention").inputs == (Use("blk.0.attention_input", index=0), Use("blk.0.attention_input", index=1))
    assert g.op("blk.1.attention_input").inputs[0] == Use("blk.0.attention_input", index=1)


def test_float_path_keeps_rows_layout_and_unfused_ffn(smol):
    g = run_pipeline(smol, PassContext(get_preset("znver4"), "f32"))
    assert "ffn" not in g.op_counts() and g.op_counts()["silu_mul"] == 30 and g.op_counts()["rope_kv_append"] == 30
    assert {w.layout for w in g.weights()} == {"rows"}
    g3 = run_pipeline(smol, PassContext(get_preset("x86-64-v3"), "f32"))
    assert {w.layout for w in g3.weights()} == {"rows"}


def test_check_catches_broken_graph(smol):
    g = smol.copy()
    op = g.op("blk.0.attn_q")
    g.g.nodes["blk.0.attn_q"]["op"] = op.__class__(**{**op.__dict__, "inputs": (Use("embed", (0, 9999)),)})
    with pytest.raises(AssertionError):
        g.check()


def test_inspect_cli(model_path):
    from ellm.compiler.inspect import inspect_model

    text = inspect_model(model_path)
    # auto: q4 K and V (36 bytes per token and head each, with the f16 min/scale), keys of layers 0-3 in q8
    # (68): 3 heads * (30 * 36 + 4 * 32 + 30 * 36) = 6,864 = 29.8% of float16's 2 * 30 * 192 * 2 = 23,040
    assert "K q8 (0-3) q4 (4-29), V q4" in text and "6,864 bytes per token (29.8% of float16" in text
    f16 = inspect_model(model_path, "f16", "f16")
    assert "23,400 bytes per token" in f16  # 23,040 + the per-block (min, max) key summaries
    assert "Q4_1" in text and "Q8_0" in text
    assert "attention_input      0 ->    30" in text
