"""The inference engine: a loaded artifact, a persistent KV cache written in place, prefill/decode/generate.

Every forward step, whatever its number of tokens, is one call into the compiled Relax VM.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..errors import ContextOverflowError, EllmError
from .artifact import Artifact
from .rope import rope_table
from .sampling import sample


def set_threads(n: int) -> None:
    """Use `n` threads of TVM's pool for the following kernels."""
    import tvm

    if tvm.runtime.num_threads() != n:
        tvm.get_global_func("runtime.config_threadpool")(1, n)


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose KV came from the cache
    prefill_s: float = 0.0
    ttft_s: float = 0.0  # call start -> first new token chosen
    decode_tokens: int = 0  # tokens produced by decode steps (all but the first)
    decode_s: float = 0.0
    stop_reason: str = ""

    @property
    def prefill_tok_s(self) -> float:
        n = self.prompt_tokens - self.reused_tokens
        return n / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


@dataclass
class _Cache:
    """Which tokens the KV tensors hold (positions 0..n-1) and how many were written by prefill steps."""

    tokens: list[int] = field(default_factory=list)
    exact: int = 0  # leading tokens written by the prefill path: reusing them reproduces a fresh run bit for bit

    def truncate(self, n: int) -> None:
        del self.tokens[n:]
        self.exact = min(self.exact, n)


class Engine:
    def __init__(
        self,
        artifact: Artifact,
        threads: int | None = None,
        ctx_size: int | None = None,
        prefill_chunk: int | None = None,
        rope_scaling: tuple[str, float] | None = None,
    ):
        """`rope_scaling`: (kind, factor) replacing the GGUF's RoPE scaling, e.g. ("yarn", 4.0) to run past
        the trained context."""
        import tvm
        from tvm import relax

        cfg = artifact.config
        if rope_scaling is not None:
            cfg = cfg.with_rope_scaling(*rope_scaling)
        self.artifact = artifact
        self.config = cfg
        self.threads = int(threads or os.cpu_count() or 1)
        if self.threads < 1:
            raise EllmError(f"threads must be at least 1, got {threads}")
        self.ctx_size = int(ctx_size or cfg.ctx_train)
        if self.ctx_size < 1:
            raise EllmError(f"ctx_size must be at least 1, got {ctx_size}")
        max_chunk = int(artifact.manifest["max_chunk"])
        self.prefill_chunk = int(prefill_chunk or max_chunk)
        if not 1 <= self.prefill_chunk <= max_chunk:
            raise EllmError(f"prefill_chunk must be between 1 and the artifact's max_chunk {max_chunk}, got {prefill_chunk}")
        self.tokenizer = artifact.tokenizer()
        set_threads(self.threads)
        if any(f.startswith("amx") for f in artifact.manifest["target"]["required_cpu_features"]):
            from .amx import request_amx_permission

            request_amx_permission()

        self._vm = relax.VirtualMachine(artifact.load_module(), tvm.cpu())
        self._fn = {e["name"]: self._vm[e["name"]] for e in artifact.manifest["entries"]}
        self._params = tvm.runtime.convert([tvm.runtime.from_dlpack(a) for a in artifact.map_params()])
        self._rope = tvm.runtime.tensor(rope_table(cfg, self.ctx_size))
        # K: [n_layers, n_kv_heads, ctx/16, head_dim, 16], V: [n_layers, n_kv_heads, ctx, head_dim];
        # only positions < len(cache.tokens) are ever read.
        kb = int(artifact.manifest["kv_cache"]["k_block"])
        blocks = -(-self.ctx_size // kb)
        L, Hkv, hd = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        self._k = tvm.runtime.empty((L, Hkv, blocks, hd, kb), artifact.kv_dtype, tvm.cpu())
        self._v = tvm.runtime.empty((L, Hkv, self.ctx_size, hd), artifact.kv_dtype, tvm.cpu())
        self._cache = _Cache()
        self.stats = GenerationStats()

    @classmethod
    def load(cls, path: str | Path, threads: int | None = None, ctx_size: int | None = None, **kw) -> Engine:
        return cls(Artifact.open(path), threads=threads, ctx_size=ctx_size, **kw)

    # --- cache ------------------------------------------------------------------------------
    @property
    def n_cached(self) -> int:
        return len(self._cache.tokens)

    def truncate(self, n: int) -> None:
        """Forget cached tokens from position n on; the next step writes at position n."""
        if not 0 <= n <= self.n_cached:
            raise ValueError(f"cannot truncate a cache of {self.n_cached} tokens to {n}")
        self._cache.truncate(n)

    def reset(self) -> None:
        self.truncate(0)

    def kv_bytes(self) -> int:
        """Bytes allocated for the K and V caches."""
        return (int(np.prod(self._k.shape)) + int(np.prod(self._v.shape))) * np.dtype(self.artifact.kv_dtype).itemsize

    # --- forward steps -----------------------------------------------------------------------
    def _check_ids(self, ids: Sequence[int]) -> np.ndarray:
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.config.vocab_size):
            raise EllmError(f"token id out of range [0, {self.config.vocab_size})")
        return arr.astype(np.int32)

    def _step(self, entry: str, ids: np.ndarray) -> np.ndarray:
        """Run `ids` at the next cache positions; one VM call."""
        import tvm

        pos = self.n_cached
        if pos + len(ids) > self.ctx_size:
            raise ContextOverflowError(
                f"{pos + len(ids)} tokens do not fit in the context of {self.ctx_size} tokens (use --ctx-size to enlarge it)"
            )
        out = self._fn[entry](tvm.runtime.tensor(ids), pos, self._rope, self._k, self._v, self._params)
        self._cache.tokens.extend(int(i) for i in ids)
        return out.numpy()

    def prefill(self, ids: Sequence[int], all_logits: bool = False, progress: Callable[[int, int], None] | None = None):
        """Append `ids` to the cache in chunks; logits of the last token [vocab] (or of all, [len, vocab])."""
        set_threads(self.threads)
        arr = self._check_ids(ids)
        if arr.size == 0:
            raise EllmError("prefill needs at least one token")
        exact = self._cache.exact == self.n_cached
        outs = []
        for start in range(0, len(arr), self.prefill_chunk):
            chunk = arr[start : start + self.prefill_chunk]
            outs.append(self._step("prefill_all" if all_logits else "prefill", chunk))
            if progress:
                progress(start + len(chunk), len(arr))
        if exact:
            self._cache.exact = self.n_cached
        return np.concatenate(outs, axis=0) if all_logits else outs[-1][0]

    def decode(self, token: int) -> np.ndarray:
        """Append one token; logits of it [vocab]."""
        set_threads(self.threads)
        return self._step("decode", self._check_ids([token]))[0]

    # --- the public API ----------------------------------------------------------------------
    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """[len(ids), vocab] float32 logits, teacher-forced from an empty cache with dense attention."""
        self.reset()
        return self.prefill(ids, all_logits=True)

    def generate(
        self,
        ids: Sequence[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        stop_at_eog: bool = True,
        on_token: Callable[[int], None] | None = None,
        progress: Callable[[int, int], None] | None = None,
    ) -> list[int]:
        """New token ids continuing `ids` (greedy at temperature 0).

        Cached KV of a common prefix written by earlier prefill steps is reused; that reproduces a fresh
        run exactly, because a prefill step's result for a token does not depend on how it was chunked.
        """
        t0 = time.perf_counter()
        arr = self._check_ids(ids)
        if arr.size == 0:
            raise EllmError("generate needs a non-empty prompt")
        if arr.size > self.ctx_size:
            raise ContextOverflowError(
                f"the prompt has {arr.size} tokens but the context holds {self.ctx_size} (use --ctx-size to enlarge it)"
            )
        if max_new_tokens < 0:
            raise EllmError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        rng = np.random.default_rng(seed)
        stats = self.stats = GenerationStats(prompt_tokens=int(arr.size))
        if max_new_tokens == 0:
            stats.stop_reason = "length"
            return []

        cached = self._cache.tokens[: self._cache.exact]
        common = 0
        for a, b in zip(cached, arr.tolist()):
            if a != b:
                break
            common += 1
        reuse = min(common, arr.size - 1)  # the last prompt token always runs: its logits choose token 1
        self.truncate(reuse)
        stats.reused_tokens = reuse
        logits = self.prefill(arr[reuse:], progress=progress)
        stats.prefill_s = time.perf_counter() - t0

        out: list[int] = []
        t_dec = None
        while True:
            tok = sample(logits, temperature, rng)
            if not out:
                stats.ttft_s = time.perf_counter() - t0
                t_dec = time.perf_counter()
            out.append(tok)
            if on_token:
                on_token(tok)
            if stop_at_eog and self.tokenizer.is_eog(tok):
                stats.stop_reason = "eog"
                break
            if len(out) >= max_new_tokens:
                stats.stop_reason = "length"
                break
            if self.n_cached >= self.ctx_size:
                stats.stop_reason = "context"
                break
            logits = self.decode(tok)
            stats.decode_tokens += 1
        stats.decode_s = time.perf_counter() - t_dec if stats.decode_tokens else 0.0
        return out
