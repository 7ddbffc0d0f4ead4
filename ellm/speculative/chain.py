"""The speculative decoding loop: draft, verify k tokens in one step, keep the accepted ones' KV, roll
back the rest; with a plain decode step wherever the controller judges a chain not worth its cost."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from ..runtime.sampling import sample
from .accept import accept_greedy, accept_sampled
from .config import SpeculativeConfig
from .controller import ChainController
from .ngram import NgramIndex

if TYPE_CHECKING:
    from ..runtime.engine import Engine, GenerationStats


def run_chain(eng: Engine, context: list[int], first: int, emit: Callable[[int], bool], stats: GenerationStats,
              cfg: SpeculativeConfig, controller: ChainController, temperature: float, rng: np.random.Generator,
              remaining: Callable[[], int]) -> None:
    """Continue after `first` (chosen, not yet in the cache) until `emit` says stop. `context`: the prompt.
    `remaining()`: how many more tokens may be emitted."""
    index = NgramIndex(cfg.ngram_max, cfg.ngram_min, context)
    index.append(first)
    tok = first
    while True:
        if eng.n_cached >= eng.ctx_size:
            stats.stop_reason = "context"
            return
        room = min(remaining() - 1, eng.ctx_size - eng.n_cached - 1, eng.max_verify - 1, cfg.chain)
        draft, matched = index.propose(room) if room > 0 else ([], 0)
        key = ("ngram", matched)
        k = controller.length(key, len(draft)) if draft else 0
        if k == 0:
            t = time.perf_counter()
            logits = eng.decode(tok)
            controller.timed(0, time.perf_counter() - t)
            nxt = sample(logits, temperature, rng)
            if draft:
                controller.shadow(key, draft[0] == nxt)
            stats.decode_steps += 1
            new = [nxt]
        else:
            chain = draft[:k]
            base = eng.n_cached
            t = time.perf_counter()
            rows = eng.verify([tok, *chain])
            controller.timed(k, time.perf_counter() - t)
            if temperature == 0:
                n, nxt = accept_greedy(rows, chain)
            else:
                n, nxt = accept_sampled(rows, chain, temperature, rng)
            controller.accepted(key, k, n)
            stats.verify_steps += 1
            stats.drafted += k
            stats.accepted += n
            eng.truncate(base + 1 + n)  # tok and the accepted tokens keep their KV
            new = [*chain[:n], nxt]
        for x in new:
            stats.decode_tokens += 1
            if emit(x):
                return
            index.append(x)
        tok = new[-1]
