"""Write a llama-architecture GGUF of a real shape with random weights, tensor by tensor (an 8B file never sits
in memory), to a temporary name renamed into place when complete."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import gguf
import numpy as np
from gguf import GGMLQuantizationType as G

from ..errors import EllmError
from .blocks import random_blocks, row_bytes
from .shapes import ModelShape
from .type_mix import TypeMix
from .vocab import byte_bpe_vocab

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}{% if add_generation_prompt %}<|start_header_id|>assistant"
    "<|end_header_id|>\n\n{% endif %}"
)


@dataclass(frozen=True)
class TensorPlan:
    name: str
    rows: int  # output features (or vocabulary entries)
    cols: int  # input features
    qtype: G


def tensor_plan(shape: ModelShape, mix: TypeMix) -> list[TensorPlan]:
    """Every tensor of the file in llama.cpp's order, with its type under `mix`."""
    s, hd = shape, shape.head_dim
    out = [TensorPlan("token_embd.weight", s.vocab, s.d_model, mix.tensor_type("token_embd", 0, s.n_layers, s.tied))]
    for i in range(s.n_layers):
        p = f"blk.{i}."
        out.append(TensorPlan(p + "attn_norm.weight", 1, s.d_model, G.F32))
        for role, rows, cols in (("attn_q", s.n_heads * hd, s.d_model), ("attn_k", s.n_kv_heads * hd, s.d_model),
                                 ("attn_v", s.n_kv_heads * hd, s.d_model), ("attn_output", s.d_model, s.n_heads * hd)):
            out.append(TensorPlan(p + role + ".weight", rows, cols, mix.tensor_type(role, i, s.n_layers, s.tied)))
        out.append(TensorPlan(p + "ffn_norm.weight", 1, s.d_model, G.F32))
        for role, rows, cols in (("ffn_gate", s.d_ff, s.d_model), ("ffn_up", s.d_ff, s.d_model), ("ffn_down", s.d_model, s.d_ff)):
            out.append(TensorPlan(p + role + ".weight", rows, cols, mix.tensor_type(role, i, s.n_layers, s.tied)))
    out.append(TensorPlan("output_norm.weight", 1, s.d_model, G.F32))
    if not s.tied:
        out.append(TensorPlan("output.weight", s.vocab, s.d_model, mix.tensor_type("output", 0, s.n_layers, s.tied)))
    return out


def _metadata(w: gguf.GGUFWriter, shape: ModelShape, mix: TypeMix) -> None:
    s = shape
    w.add_name(f"synthetic {s.name} {mix.name} (random weights)")
    w.add_block_count(s.n_layers)
    w.add_context_length(s.ctx)
    w.add_embedding_length(s.d_model)
    w.add_feed_forward_length(s.d_ff)
    w.add_head_count(s.n_heads)
    w.add_head_count_kv(s.n_kv_heads)
    w.add_key_length(s.head_dim)
    w.add_value_length(s.head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(s.rope_base)
    w.add_rope_dimension_count(s.head_dim)
    w.add_vocab_size(s.vocab)
    w.add_file_type(mix.file_type)
    tokens, types, merges = byte_bpe_vocab(s.vocab)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("llama-bpe")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tokens.index("<|begin_of_text|>"))
    w.add_eos_token_id(tokens.index("<|eot_id|>"))
    w.add_add_bos_token(True)
    w.add_chat_template(CHAT_TEMPLATE)


def write_synthetic(path: str | Path, shape: ModelShape, mix: TypeMix, seed: int = 0, force: bool = False,
                    log: Callable[[str], None] = lambda s: None) -> Path:
    """Write the GGUF; returns its path. Random quants with scales for weights of standard deviation ~0.02,
    RMSNorm gains near 1."""
    path = Path(path)
    if path.exists() and not force:
        raise EllmError(f"{path} already exists (pass --force to replace it)")
    plan = tensor_plan(shape, mix)
    for t in plan:
        block = gguf.GGML_QUANT_SIZES[t.qtype][0]
        if t.cols % block:
            raise EllmError(f"{t.name}: {t.cols} columns are not a multiple of the {t.qtype.name} block ({block})")
    rng = np.random.default_rng(seed)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.partial")
    try:
        w = gguf.GGUFWriter(str(tmp), "llama")
        _metadata(w, shape, mix)
        for t in plan:
            if t.qtype is G.F32:
                w.add_tensor_info(t.name, (t.cols,), np.dtype(np.float32), 4 * t.cols)
            else:
                nbytes = t.rows * row_bytes(t.qtype, t.cols)
                w.add_tensor_info(t.name, (t.rows, row_bytes(t.qtype, t.cols)), np.dtype(np.uint8), nbytes, raw_dtype=t.qtype)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for t in plan:
            if t.qtype is G.F32:
                data = (1.0 + 0.05 * rng.standard_normal(t.cols)).astype(np.float32)
            else:
                data = random_blocks(t.qtype, t.rows, t.cols, rng)
            w.write_tensor_data(data)
            if t.name.endswith("ffn_down.weight"):
                log(f"  {int(t.name.split('.')[1]) + 1:3d}/{shape.n_layers} layers written")
        w.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
