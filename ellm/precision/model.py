"""A float32 NumPy forward pass of a llama-family GGUF, built to re-run from any layer with one part lowered.

This is the sensitivity analysis's fast exact path. It computes the unmodified model (weights dequantised
from their source types, float32 activations, K and V rounded through float16 as the dense reference cache
stores them) and, from a saved layer input, the same model with one part changed: a weight replaced by its
re-quantised values, one layer's K or V read from a quantised block store, or one layer's matmul inputs
rounded to 8-bit integers. Re-running from layer l costs (L - l) / L of a pass.

Shapes: x [T, d_model]; q [T, n_heads, hd]; k, v [T, n_kv_heads, hd]; a layer's cache [P, n_kv_heads, hd].
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np

from ..compiler.gguf_file import GGUFFile
from ..config import ModelConfig
from ..quant import QuantType
from ..quant.requantize import dequantize, requantize
from ..targets.detect import available_memory  # noqa: F401 (compile_target and its tests reach it here)
from ..runtime.rope import rope_table

F32 = np.float32
# (positions of the keys, queries' first position, keys [P, Hkv, hd]) -> the keys the queries read; None: as given
KVRead = Callable[[np.ndarray, int], np.ndarray]
# (scaled queries [Hkv, G, c, hd], keys as read [n, Hkv, hd], scores [Hkv, G, c, n], first position) -> additive
# mask [Hkv, 1, c, n] of the keys each query reads (precision/sparse_read.py); None: every key
KeySelect = Callable[[np.ndarray, np.ndarray, np.ndarray, int], np.ndarray]


@functools.lru_cache(maxsize=8)
def _causal(c: int) -> np.ndarray:
    """[c, c] additive mask: -inf above the diagonal."""
    return np.triu(np.full((c, c), -np.inf, F32), 1)


def _f16(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).astype(F32)


def lowered_values(gf: GGUFFile, name: str, t: QuantType) -> np.ndarray:
    """A GGUF weight's float values once stored as `t`: re-quantised from its source type, dequantised."""
    return dequantize(requantize(gf.raw(name), gf.weight_format(name).qtype, t), t)


def round_activations(x: np.ndarray, bits: int, group: int = 32) -> np.ndarray:
    """The integer kernels' activation rounding: symmetric, one scale per `group` inputs (int16 is two int8
    halves, so its rounding error is that of 16 bits)."""
    T, K = x.shape
    g = x.reshape(T, K // group, group)
    qmax = F32((1 << (bits - 1)) - 1)
    s = np.abs(g).max(axis=2, keepdims=True) / qmax
    s = np.where(s > 0, s, F32(1))
    return (np.rint(g / s) * s).reshape(T, K).astype(F32)


def analysis_memory(cfg: ModelConfig, head_candidates: int = 2, ctx: int = 4096) -> int:
    """Bytes the analysis holds at once: every weight in float32, the head again per lower candidate, and a
    long run's layer inputs and caches (ctx tokens)."""
    d, L = cfg.d_model, cfg.n_layers
    kv = cfg.n_kv_heads * cfg.head_dim
    per_layer = d * (cfg.n_heads * cfg.head_dim) * 2 + d * kv * 2 + 3 * d * cfg.d_ff
    head = cfg.vocab_size * d
    weights = L * per_layer + head * (1 if cfg.tied_embeddings else 2)
    activations = ctx * (d * (L + 1) // 16 + 2 * kv * L + 4 * d) + 128 * cfg.vocab_size * 2
    return 4 * (weights + head * head_candidates + activations)


@dataclass
class LayerEdit:
    """What one re-run changes in the layer it starts at: weights (GGUF name -> float values), how the
    layer's attention reads K and V, which keys it reads, and the bits of its matmul inputs."""

    weights: dict[str, np.ndarray] | None = None
    read_k: KVRead | None = None
    read_v: KVRead | None = None
    act_bits: int | None = None
    select: KeySelect | None = None


class FloatModel:
    def __init__(self, gf: GGUFFile, cfg: ModelConfig, max_ctx: int = 8192):
        self.cfg = cfg
        self.w: dict[str, np.ndarray] = {}
        for name in self._weight_names():
            info = gf.info(name)
            if info.ndim == 1 or info.rows == 1:
                self.w[name] = np.asarray(gf.vector(name), dtype=F32)
            else:
                self.w[name] = dequantize(gf.raw(name), gf.weight_format(name).qtype)
        self.head_name = "token_embd.weight" if cfg.tied_embeddings else "output.weight"
        self.rope = rope_table(cfg, max_ctx)  # [ctx, rope_dim]: cos | sin

    def _weight_names(self) -> list[str]:
        cfg = self.cfg
        names = ["token_embd.weight", "output_norm.weight"] + ([] if cfg.tied_embeddings else ["output.weight"])
        for i in range(cfg.n_layers):
            p = f"blk.{i}."
            names += [p + n + ".weight" for n in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm",
                                                   "ffn_gate", "ffn_up", "ffn_down")]
            if cfg.attn_bias:
                names += [p + n + ".bias" for n in ("attn_q", "attn_k", "attn_v")]
        return names

    # --- pieces ----------------------------------------------------------------------------
    def embed(self, tokens: np.ndarray) -> np.ndarray:
        return self.w["token_embd.weight"][np.asarray(tokens)].astype(F32)

    def _norm(self, x: np.ndarray, g: np.ndarray) -> np.ndarray:
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + F32(self.cfg.rms_eps)) * g

    def _rope(self, x: np.ndarray, pos0: int) -> np.ndarray:
        # x [T, heads, hd]; adjacent pairs (2i, 2i+1), or (i, i + rope_dim/2) for NeoX-style models
        cfg = self.cfg
        T = x.shape[0]
        half = cfg.rope_dim // 2
        cos = self.rope[pos0 : pos0 + T, :half][:, None, :]
        sin = self.rope[pos0 : pos0 + T, half:][:, None, :]
        x = x.copy()
        if cfg.rope_neox:
            a, b = x[..., :half].copy(), x[..., half : 2 * half].copy()
            x[..., :half], x[..., half : 2 * half] = a * cos - b * sin, a * sin + b * cos
        else:
            a, b = x[..., 0 : 2 * half : 2].copy(), x[..., 1 : 2 * half : 2].copy()
            x[..., 0 : 2 * half : 2], x[..., 1 : 2 * half : 2] = a * cos - b * sin, a * sin + b * cos
        return x

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Final hidden states [T, d] -> logits [T, vocab]."""
        return self.head_input(x) @ self.w[self.head_name].T

    def head_input(self, x: np.ndarray) -> np.ndarray:
        return self._norm(x, self.w["output_norm.weight"])

    # --- one layer -------------------------------------------------------------------------
    def layer(self, i: int, x: np.ndarray, pos0: int, past: tuple[np.ndarray, np.ndarray] | None = None,
              edit: LayerEdit | None = None, chunk: int = 256, pool=None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Layer i on x [T, d] at positions pos0.. after `past` (K, V [P, Hkv, hd], P = pos0, float16-rounded).
        Returns (x out, this step's K, V float16-rounded). `pool`: an executor to spread attention chunks over."""
        cfg = self.cfg
        p = f"blk.{i}."
        edit = edit or LayerEdit()
        W = {**self.w, **edit.weights} if edit.weights else self.w
        act = (lambda a: round_activations(a, edit.act_bits)) if edit.act_bits else (lambda a: a)  # noqa: E731
        T, H, Hkv, hd = x.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        h = act(self._norm(x, W[p + "attn_norm.weight"]))
        q = h @ W[p + "attn_q.weight"].T
        k = h @ W[p + "attn_k.weight"].T
        v = h @ W[p + "attn_v.weight"].T
        if cfg.attn_bias:
            q, k, v = q + W[p + "attn_q.bias"], k + W[p + "attn_k.bias"], v + W[p + "attn_v.bias"]
        q = self._rope(q.reshape(T, H, hd), pos0)
        k = _f16(self._rope(k.reshape(T, Hkv, hd), pos0))
        v = _f16(v.reshape(T, Hkv, hd))
        K = k if past is None else np.concatenate([past[0], k])  # [P + T, Hkv, hd]
        V = v if past is None else np.concatenate([past[1], v])
        att = np.empty((T, H, hd), F32)
        g = H // Hkv
        scale = F32(1 / np.sqrt(hd))

        def attend(s: int) -> None:
            qs = q[s : s + chunk]  # [c, H, hd]
            c, first = qs.shape[0], pos0 + s
            n = first + c  # keys visible to the last query of the chunk
            Kr = edit.read_k(K[:n], first) if edit.read_k else K[:n]
            Vr = edit.read_v(V[:n], first) if edit.read_v else V[:n]
            qh = qs.reshape(c, Hkv, g, hd).transpose(1, 2, 0, 3).reshape(Hkv, g * c, hd)  # [Hkv, g*c, hd]
            sc = np.matmul(qh, Kr.transpose(1, 2, 0)) * scale  # [Hkv, g*c, n]
            sc = sc.reshape(Hkv, g, c, n)
            if edit.select:
                sc += edit.select(qh.reshape(Hkv, g, c, hd) * scale, Kr, sc, first)
            sc[..., first:] += _causal(c)  # the chunk's own keys: none from its future
            sc -= sc.max(axis=-1, keepdims=True)
            np.exp(sc, out=sc)
            sc /= sc.sum(axis=-1, keepdims=True)
            o = np.matmul(sc.reshape(Hkv, g * c, n), Vr.transpose(1, 0, 2))  # [Hkv, g*c, hd]
            att[s : s + c] = o.reshape(Hkv, g, c, hd).transpose(2, 0, 1, 3).reshape(c, H, hd)

        starts = range(0, T, chunk)
        if pool is not None and len(starts) > 1 and not (edit.read_k or edit.read_v):
            from threadpoolctl import threadpool_limits

            with threadpool_limits(1):  # two threads, one BLAS thread each
                list(pool.map(attend, starts))  # chunks are independent (a block reader is not: it grows in order)
        else:
            for s in starts:
                attend(s)
        x = x + act(att.reshape(T, H * hd)) @ W[p + "attn_output.weight"].T
        h = act(self._norm(x, W[p + "ffn_norm.weight"]))
        gate = h @ W[p + "ffn_gate.weight"].T
        up = h @ W[p + "ffn_up.weight"].T
        s = gate / (F32(1) + np.exp(-gate)) * up
        x = x + act(s) @ W[p + "ffn_down.weight"].T
        return x.astype(F32), k, v

    # --- whole passes ----------------------------------------------------------------------
    def run(self, tokens: np.ndarray, keep_kv: bool = False, keep_from: int = 0, final_from: int | None = None):
        """Every layer over `tokens` from position 0. Returns (layer inputs [L + 1] of [T - keep_from, d]: the
        last is the final hidden state, kept from `final_from` if given; per layer (K, V) of all positions if
        keep_kv). Long runs spread their attention over two threads."""
        from concurrent.futures import ThreadPoolExecutor

        x = self.embed(tokens)
        xs, kvs = [x[keep_from:]], []
        with ThreadPoolExecutor(2) as pool:
            for i in range(self.cfg.n_layers):
                x, k, v = self.layer(i, x, 0, pool=pool if len(tokens) > 1024 else None)
                last = i == self.cfg.n_layers - 1 and final_from is not None
                xs.append(x[final_from if last else keep_from :])
                if keep_kv:
                    kvs.append((k, v))
        return xs, kvs

    def rerun(self, start: int, x: np.ndarray, pos0: int, edits: dict[int, LayerEdit],
              past: list[tuple[np.ndarray, np.ndarray]] | None = None, chunk: int = 256) -> np.ndarray:
        """From layer `start`'s input x (positions pos0..) with `edits` applied at their layers; `past`: every
        layer's cache before pos0 (None: x starts the sequence). `chunk`: queries per attention step in edited
        layers (a block where an edit reads a block store: one block's queries read the same tiers). Returns the
        final hidden state."""
        for i in range(start, self.cfg.n_layers):
            edit = edits.get(i)
            x, _, _ = self.layer(i, x, pos0, None if past is None else past[i], edit, chunk if edit else 256)
        return x
