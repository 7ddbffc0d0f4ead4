"""Tiny synthetic GGUF models (random weights, real tokenizer structure) to exercise every type and architecture."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
from gguf import GGMLQuantizationType as G
from quantizers import quantize

from ellm.synth.vocab import bytes_to_unicode

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def gpt2_vocab(vocab_size: int):
    """Specials, 256 byte tokens, then merges of frequent English pairs up to vocab_size."""
    b2u = bytes_to_unicode()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + [b2u[b] for b in range(256)]
    merges = []
    words = ["th", "he", "in", "er", "an", "Ġt", "Ġa", "on", "re", "at", "en", "nd", "Ġth", "Ġthe", "ing", "is", "es", "or"]
    for w in words:
        if len(tokens) >= vocab_size:
            break
        # split into two existing tokens
        for cut in range(len(w) - 1, 0, -1):
            a, b = w[:cut], w[cut:]
            if a in tokens and b in tokens:
                merges.append(f"{a} {b}")
                tokens.append(w)
                break
    while len(tokens) < vocab_size:
        tokens.append(f"<unused{len(tokens)}>")
    types = [3] * len(specials) + [1] * (len(tokens) - len(specials))
    for i, t in enumerate(tokens):
        if t.startswith("<unused"):
            types[i] = 4
    return tokens, types, merges


def spm_vocab(vocab_size: int):
    """SentencePiece-style: <unk>, <s>, </s>, byte tokens <0xNN>, then pieces with scores."""
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3] + [6] * 256
    scores = [0.0, 0.0, 0.0] + [0.0] * 256
    pieces = ["▁", "t", "h", "e", "a", "n", "i", "s", "o", "r", "th", "he", "▁t", "▁th", "▁the", "in", "an", "er", "▁a", "is"]
    for k, p in enumerate(pieces):
        if len(tokens) >= vocab_size:
            break
        tokens.append(p)
        types.append(1)
        scores.append(-float(k))
    while len(tokens) < vocab_size:
        tokens.append(f"▁x{len(tokens)}")
        types.append(1)
        scores.append(-1000.0 - len(tokens))
    return tokens, types, scores


def write_model(
    path: Path,
    *,
    arch: str = "llama",
    types: dict[str, G] | None = None,
    n_layers: int = 2,
    d: int = 256,
    ff: int = 512,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 320,
    ctx: int = 512,
    tokenizer: str = "gpt2",
    tied: bool = True,
    seed: int = 0,
) -> Path:
    """Write a small llama/qwen2 GGUF. `types` maps roles (embd, q, k, v, o, gate, up, down, head) to tensor types."""
    t = {"embd": G.Q8_0, "q": G.Q4_1, "k": G.Q4_1, "v": G.Q4_1, "o": G.Q4_1, "gate": G.Q4_1, "up": G.Q4_1, "down": G.Q4_1, "head": G.Q8_0}
    t.update(types or {})
    rng = np.random.default_rng(seed)
    hd = d // heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(n_layers)
    w.add_context_length(ctx)
    w.add_embedding_length(d)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_rope_dimension_count(hd)
    if tokenizer == "gpt2":
        tokens, ttypes, merges = gpt2_vocab(vocab)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("gpt2")
        w.add_token_list(tokens)
        w.add_token_types(ttypes)
        w.add_token_merges(merges)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_add_bos_token(False)
    else:
        tokens, ttypes, scores = spm_vocab(vocab)
        w.add_tokenizer_model("llama")
        w.add_token_list(tokens)
        w.add_token_types(ttypes)
        w.add_token_scores(scores)
        w.add_bos_token_id(1)
        w.add_eos_token_id(2)
        w.add_unk_token_id(0)
    w.add_chat_template(CHAT_TEMPLATE)

    def mat(name, rows, cols, qtype, scale):
        raw = quantize(rng.standard_normal((rows, cols)).astype(np.float32) * scale, int(qtype))
        w.add_tensor(name, raw, raw_dtype=qtype)

    def vec(name, n, center=1.0, spread=0.1):
        w.add_tensor(name, (center + spread * rng.standard_normal(n)).astype(np.float32))

    mat("token_embd.weight", vocab, d, t["embd"], 1.0)
    for i in range(n_layers):
        p = f"blk.{i}."
        vec(p + "attn_norm.weight", d)
        vec(p + "ffn_norm.weight", d)
        mat(p + "attn_q.weight", heads * hd, d, t["q"], 0.08)
        mat(p + "attn_k.weight", kv_heads * hd, d, t["k"], 0.08)
        mat(p + "attn_v.weight", kv_heads * hd, d, t["v"], 0.08)
        mat(p + "attn_output.weight", d, heads * hd, t["o"], 0.05)
        mat(p + "ffn_gate.weight", ff, d, t["gate"], 0.08)
        mat(p + "ffn_up.weight", ff, d, t["up"], 0.08)
        mat(p + "ffn_down.weight", d, ff, t["down"], 0.05)
        if arch == "qwen2":
            vec(p + "attn_q.bias", heads * hd, 0.0, 0.2)
            vec(p + "attn_k.bias", kv_heads * hd, 0.0, 0.2)
            vec(p + "attn_v.bias", kv_heads * hd, 0.0, 0.2)
    vec("output_norm.weight", d)
    if not tied:
        mat("output.weight", vocab, d, t["head"], 0.08)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
