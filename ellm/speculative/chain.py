"""The speculative decoding loop: draft, verify k tokens in one step, keep the accepted ones' KV, roll
back the rest; with a plain decode step wherever the controller judges a chain not worth its cost."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Callable

import numpy as np

from .accept import accept_greedy, accept_sampled
from .config import SpeculativeConfig
from .controller import ChainController
from .drafters import MODEL_KEY

if TYPE_CHECKING:
    from ..runtime.engine import Engine, GenerationStats
    from ..runtime.sampling import Sampler
    from .drafters import CascadeDrafter, ModelDrafter, NgramDrafter

    Drafter = NgramDrafter | ModelDrafter | CascadeDrafter


def run_chain(eng: Engine, drafter: Drafter, first: int, emit: Callable[[int, np.ndarray], bool],
              stats: GenerationStats, cfg: SpeculativeConfig, controller: ChainController, sampler: Sampler,
              history: list[int], remaining: Callable[[], int]) -> None:
    """Continue after `first` (chosen, not yet in the cache) until `emit(token, logits)` says stop. `drafter`
    has seen the prompt. `history`: the prompt and the tokens emitted (the sampler's penalties count in it).
    `remaining()`: how many more tokens may be emitted."""
    temperature, rng = sampler.config.temperature, sampler.rng
    drafter.append(first)
    tok = first
    while True:
        if eng.n_cached >= eng.ctx_size:
            stats.stop_reason = "context"
            return
        room = min(remaining() - 1, eng.ctx_size - eng.n_cached - 1, eng.max_verify - 1, cfg.chain)
        key, available = drafter.offer(room) if room > 0 else (None, 0)
        k = controller.length(key, available, drafted=key == MODEL_KEY) if available else 0
        chain: list[int] = []
        if k:
            t = time.perf_counter()
            chain, q = drafter.take(k, temperature, rng)
            if key == MODEL_KEY:
                controller.timed_draft(k, time.perf_counter() - t)
        if not chain:
            t = time.perf_counter()
            logits = eng.decode(tok)
            controller.timed(0, time.perf_counter() - t)
            nxt = sampler.choose(logits, history)
            if available:
                drafter.declined(controller, key, nxt)
            stats.decode_steps += 1
            new, new_rows = [nxt], logits[None, :]
        else:
            base = eng.n_cached
            t = time.perf_counter()
            rows = eng.verify([tok, *chain])
            controller.timed(len(chain), time.perf_counter() - t)
            if temperature == 0:
                n, nxt = accept_greedy(_penalised(sampler, rows, history, chain), chain)
            else:
                recent = sampler.recent(history)
                p = np.stack([sampler.probabilities(rows[i], recent + chain[:i]) for i in range(len(rows))])
                n, nxt = accept_sampled(p, chain, rng, q)
            controller.accepted(key, len(chain), n)
            stats.verify_steps += 1
            stats.drafted += len(chain)
            stats.accepted += n
            eng.truncate(base + 1 + n)  # tok and the accepted tokens keep their KV
            new, new_rows = [*chain[:n], nxt], rows
        for x, row in zip(new, new_rows):
            stats.decode_tokens += 1
            if emit(x, row):
                return
            drafter.append(x)
        tok = new[-1]


def _penalised(sampler: Sampler, rows: np.ndarray, history: list[int], chain: list[int]) -> np.ndarray:
    """Verification rows [len(chain) + 1, vocab] with the repetition penalties each row's position sees."""
    if not sampler.config.penalises:
        return rows
    recent = sampler.recent(history)
    return np.stack([sampler.penalise(rows[i], recent + chain[:i]) for i in range(len(rows))])
