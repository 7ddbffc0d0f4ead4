"""An independent float64 NumPy implementation of the llama forward pass.

It reads the GGUF with the `gguf` package and dequantises every weight with `gguf.quants.dequantize`.
It shares no code with eLLM: not its GGUF reader, config, packer, kernels or RoPE table.
"""

from __future__ import annotations

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize


class NumpyLlama:
    def __init__(self, path, kv_dtype: str | None = None):
        """`kv_dtype="float16"` rounds K (after RoPE) and V through float16, as a float16 KV cache stores them."""
        r = GGUFReader(path)

        def meta(key, default=None):
            f = r.fields.get(key)
            return default if f is None else f.contents()

        arch = meta("general.architecture")
        self.arch = arch
        self.n_layers = meta(f"{arch}.block_count")
        self.d = meta(f"{arch}.embedding_length")
        self.n_heads = meta(f"{arch}.attention.head_count")
        self.n_kv = meta(f"{arch}.attention.head_count_kv", self.n_heads)
        self.hd = meta(f"{arch}.attention.key_length", self.d // self.n_heads)
        self.eps = meta(f"{arch}.attention.layer_norm_rms_epsilon")
        self.base = meta(f"{arch}.rope.freq_base", 10000.0)
        self.rope_dim = meta(f"{arch}.rope.dimension_count", self.hd)
        self.neox = arch == "qwen2"
        self.kv_dtype = kv_dtype
        self.w: dict[str, np.ndarray] = {}
        for t in r.tensors:
            shape = [int(x) for x in reversed(t.shape)]  # ggml order -> [rows, cols]
            self.w[t.name] = dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float64)
        self.head = self.w.get("output.weight", self.w["token_embd.weight"])

    def _norm(self, x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * g

    def _rope(self, x, positions):
        # x: [T, heads, hd]
        half = self.rope_dim // 2
        inv = self.base ** (-np.arange(half) * 2.0 / self.rope_dim)
        ang = positions[:, None] * inv[None, :]  # [T, half]
        cos, sin = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        x = x.copy()
        if self.neox:
            a, b = x[..., :half].copy(), x[..., half : 2 * half].copy()
            x[..., :half], x[..., half : 2 * half] = a * cos - b * sin, a * sin + b * cos
        else:
            a, b = x[..., 0 : 2 * half : 2].copy(), x[..., 1 : 2 * half : 2].copy()
            x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2] = a * cos - b * sin, a * sin + b * cos
        return x

    def forward(self, tokens, last_only: bool = False) -> np.ndarray:
        """[T, vocab] float64 logits of `tokens` from an empty cache (causal, dense); [1, vocab] with last_only."""
        tokens = np.asarray(tokens)
        T = len(tokens)
        pos = np.arange(T, dtype=np.float64)
        x = self.w["token_embd.weight"][tokens]
        mask = np.triu(np.full((T, T), -np.inf), 1)
        g = self.n_heads // self.n_kv
        for i in range(self.n_layers):
            p = f"blk.{i}."
            h = self._norm(x, self.w[p + "attn_norm.weight"])
            q = h @ self.w[p + "attn_q.weight"].T + self.w.get(p + "attn_q.bias", 0)
            k = h @ self.w[p + "attn_k.weight"].T + self.w.get(p + "attn_k.bias", 0)
            v = h @ self.w[p + "attn_v.weight"].T + self.w.get(p + "attn_v.bias", 0)
            q = self._rope(q.reshape(T, self.n_heads, self.hd), pos)
            k = self._rope(k.reshape(T, self.n_kv, self.hd), pos)
            v = v.reshape(T, self.n_kv, self.hd)
            if self.kv_dtype:
                k = k.astype(self.kv_dtype).astype(np.float64)
                v = v.astype(self.kv_dtype).astype(np.float64)
            att = np.empty((T, self.n_heads, self.hd))
            for hh in range(self.n_heads):
                s = q[:, hh] @ k[:, hh // g].T / np.sqrt(self.hd) + mask
                s = np.exp(s - s.max(axis=1, keepdims=True))
                att[:, hh] = (s / s.sum(axis=1, keepdims=True)) @ v[:, hh // g]
            x = x + att.reshape(T, -1) @ self.w[p + "attn_output.weight"].T
            h = self._norm(x, self.w[p + "ffn_norm.weight"])
            gate = h @ self.w[p + "ffn_gate.weight"].T
            up = h @ self.w[p + "ffn_up.weight"].T
            x = x + (gate / (1 + np.exp(-gate)) * up) @ self.w[p + "ffn_down.weight"].T
        if last_only:
            x = x[-1:]
        return self._norm(x, self.w["output_norm.weight"]) @ self.head.T

    def greedy(self, tokens, n: int) -> list[int]:
        """n greedy tokens (recomputes the prefix each step: slow but independent)."""
        seq = list(tokens)
        out = []
        for _ in range(n):
            t = int(np.argmax(self.forward(seq, last_only=True)[-1]))
            out.append(t)
            seq.append(t)
        return out
