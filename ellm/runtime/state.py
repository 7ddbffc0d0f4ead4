"""What a generate call reports (GenerationStats), how it records its tokens (Emitter), the plain decode loop
both engines run (decode_until_stop), and what a KV state holds (_Cache)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    reused_tokens: int = 0  # prompt tokens whose KV came from the cache
    prefill_s: float = 0.0
    ttft_s: float = 0.0  # call start -> first new token chosen
    decode_tokens: int = 0  # tokens produced after the first (by decode or verification steps)
    decode_s: float = 0.0
    stop_reason: str = ""
    decode_steps: int = 0  # one-token steps
    verify_steps: int = 0  # verification steps of speculative chains
    drafted: int = 0  # drafted tokens verified
    accepted: int = 0  # of them, accepted
    draft_s: float = 0.0  # of decode_s, seconds in a draft model (drafting and catching up)

    @property
    def accept_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else float("nan")

    @property
    def mean_accepted(self) -> float:
        """Drafted tokens accepted per verification step."""
        return self.accepted / self.verify_steps if self.verify_steps else float("nan")

    @property
    def steps_saved(self) -> int:
        """Tokens after the first less the forward steps that produced them."""
        return self.decode_tokens - self.decode_steps - self.verify_steps

    @property
    def prefill_tok_s(self) -> float:
        n = self.prompt_tokens - self.reused_tokens
        return n / self.prefill_s if self.prefill_s > 0 else float("nan")

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else float("nan")


@dataclass
class Emitter:
    """Records each token a generate call chooses and says when generation stops: `on_token` asked ("stop"),
    an end-of-generation token ("eog", unless `is_eog` is None), or `max_new` tokens ("length")."""

    stats: GenerationStats
    max_new: int
    history: list[int]  # the prompt and every token chosen: what the sampler's penalties count in
    is_eog: Callable[[int], bool] | None
    on_token: Callable[[int], bool | None] | None = None
    on_logits: Callable[[int, np.ndarray], None] | None = None  # the raw logits each token was chosen from
    out: list[int] = field(default_factory=list)

    def __call__(self, tok: int, row: np.ndarray) -> bool:
        """Record `tok`, chosen from logits `row`; whether generation stops here."""
        if self.on_logits:
            self.on_logits(tok, row)
        self.out.append(tok)
        self.history.append(tok)
        st = self.stats
        if self.on_token and self.on_token(tok):
            st.stop_reason = "stop"
        elif self.is_eog is not None and self.is_eog(tok):
            st.stop_reason = "eog"
        elif len(self.out) >= self.max_new:
            st.stop_reason = "length"
        return bool(st.stop_reason)


def decode_until_stop(model, tok: int, sampler, emit: Emitter) -> None:
    """One-token steps after `tok` (already emitted) until `emit` stops or the context is full. `model`: an
    engine (decode, n_cached, ctx_size); `sampler`: runtime/sampling.Sampler."""
    stats = emit.stats
    while not stats.stop_reason:
        if model.n_cached >= model.ctx_size:
            stats.stop_reason = "context"
            break
        logits = model.decode(tok)
        stats.decode_tokens += 1
        stats.decode_steps += 1
        tok = sampler.choose(logits, emit.history)
        emit(tok, logits)


@dataclass
class _Cache:
    """Which tokens the KV state holds (positions 0..n-1), how many were written by prefill steps, and
    which blocks the float16 ring still holds."""

    tokens: list[int] = field(default_factory=list)
    exact: int = 0  # leading tokens written by the prefill path: reusing them reproduces a fresh run bit for bit
    hi_block: int = -1  # the newest block written since the last reset; the ring holds the `ring` blocks up to it

    def truncate(self, n: int) -> None:
        del self.tokens[n:]
        self.exact = min(self.exact, n)
        if n == 0:
            self.hi_block = -1

    def restorable(self, n: int, block: int, recent: int, ring: int, pinned: int = 0) -> bool:
        """Whether keeping positions < n leaves a valid state: the blocks a query at n reads from the ring
        (its own, partly written, and the recent ones before it) must not have been overwritten. Pinned blocks
        keep their slots; the others cycle through ring - pinned."""
        first = max(pinned, n // block - recent + 1)
        return n == 0 or n // block < pinned or first >= self.hi_block - (ring - pinned) + 1
