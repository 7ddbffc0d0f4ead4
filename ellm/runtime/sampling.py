"""Choosing the next token from logits: penalties, then top-k, top-p, min-p, then temperature, in llama.cpp's
order, so that a request's controls mean what they mean there.

Penalties (llama.cpp's `penalties` sampler) act on the logits of tokens seen in the last `penalty_last_n`
tokens (prompt and output): a positive logit is divided by `repeat_penalty`, a negative one multiplied by it,
then `count * frequency_penalty + presence_penalty` is subtracted. Top-p and min-p are taken on the
distribution at temperature 1 (llama.cpp applies temperature last); temperature then scales what survives.
Temperature 0 is greedy: the argmax of the penalised logits (lowest id on ties).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ..errors import EllmError

# top-p first looks among this many most likely tokens (a partial sort); only when their mass is short of
# top_p does it sort the whole vocabulary
_TOP_P_CANDIDATES = 512


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    min_p: float = 0.0  # 0: off
    repeat_penalty: float = 1.0  # 1: off
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64  # the window the penalties count in (llama.cpp's default); -1: everything
    seed: int | None = None

    def __post_init__(self):
        def check(ok: bool, what: str) -> None:
            if not ok:
                raise EllmError(what)

        for name in ("temperature", "top_p", "min_p", "repeat_penalty", "presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            check(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v),
                  f"{name} must be a finite number, got {v!r}")
        check(self.temperature >= 0, f"temperature must be >= 0, got {self.temperature}")
        check(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k must be an integer >= 0, got {self.top_k!r}")
        check(0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}")
        check(0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}")
        check(self.repeat_penalty > 0, f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        check(-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        check(-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        check(isinstance(self.penalty_last_n, int) and self.penalty_last_n >= -1,
              f"penalty_last_n must be an integer >= -1, got {self.penalty_last_n!r}")
        check(self.seed is None or (isinstance(self.seed, int) and not isinstance(self.seed, bool)),
              f"seed must be an integer, got {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def penalises(self) -> bool:
        return self.penalty_last_n != 0 and (self.repeat_penalty != 1 or self.presence_penalty != 0
                                             or self.frequency_penalty != 0)

    @property
    def truncates(self) -> bool:
        return self.top_k > 0 or self.top_p < 1 or self.min_p > 0


class Sampler:
    """A SamplingConfig applied to logits, with its own seeded generator."""

    def __init__(self, config: SamplingConfig | None = None):
        self.config = config or SamplingConfig()
        seed = self.config.seed
        self.rng = np.random.default_rng(None if seed is None else seed % 2**64)  # clients send negative seeds

    def recent(self, history: list[int]) -> list[int]:
        """The part of `history` the penalties look at (a copy, to extend)."""
        c = self.config
        if not c.penalises:
            return []
        return list(history) if c.penalty_last_n < 0 else history[-c.penalty_last_n:]

    def penalise(self, logits: np.ndarray, history: Sequence[int]) -> np.ndarray:
        """The logits [vocab] after the repetition penalties over the last tokens of `history` (a new array,
        float32; the input unchanged). Without penalties: `logits` itself."""
        c = self.config
        if not c.penalises or len(history) == 0:
            return logits
        window = history if c.penalty_last_n < 0 else history[-c.penalty_last_n:]
        ids, counts = np.unique(np.asarray(window, dtype=np.int64), return_counts=True)
        out = np.array(logits, dtype=np.float32, copy=True)
        seen = out[ids]
        seen = np.where(seen <= 0, seen * c.repeat_penalty, seen / c.repeat_penalty)
        out[ids] = seen - (counts * c.frequency_penalty + c.presence_penalty)
        return out

    def probabilities(self, logits: np.ndarray, history: Sequence[int] = ()) -> np.ndarray:
        """The distribution [vocab] (float64) a token is drawn from: zero outside what top-k, top-p and min-p
        keep. Only for temperature > 0."""
        c = self.config
        if c.greedy:
            raise ValueError("a greedy sampler has no distribution")
        z = self.penalise(logits, history).astype(np.float64)
        keep = None  # indices kept by top-k / top-p, or None for all
        if c.top_k and c.top_k < z.size:
            keep = np.argpartition(-z, c.top_k - 1)[: c.top_k]
        if c.top_p < 1 or c.min_p > 0:
            cand = np.arange(z.size) if keep is None else keep
            zc = z[cand]
            p1 = np.exp(zc - zc.max())  # the distribution at temperature 1 over the candidates
            p1 /= p1.sum()
            if c.top_p < 1:
                cand, p1 = _top_p(cand, p1, c.top_p)
            if c.min_p > 0:
                m = p1 >= c.min_p * p1.max()
                cand, p1 = cand[m], p1[m]
            keep = cand
        out = np.zeros(z.size, dtype=np.float64)
        zk = z if keep is None else z[keep]
        pk = np.exp((zk - zk.max()) / c.temperature)
        pk /= pk.sum()
        if keep is None:
            return pk
        out[keep] = pk
        return out

    def choose(self, logits: np.ndarray, history: Sequence[int] = ()) -> int:
        """The next token: the argmax at temperature 0 (lowest id on ties), else a draw."""
        if self.config.greedy:
            return int(np.argmax(self.penalise(logits, history)))
        return draw(self.probabilities(logits, history), self.rng)


def _top_p(cand: np.ndarray, p: np.ndarray, top_p: float) -> tuple[np.ndarray, np.ndarray]:
    """The smallest set of most likely candidates whose mass reaches top_p (ties broken by lower index)."""
    n = min(_TOP_P_CANDIDATES, p.size)
    head = np.argpartition(-p, n - 1)[:n] if n < p.size else np.arange(p.size)
    order = head[np.lexsort((cand[head], -p[head]))]
    cum = np.cumsum(p[order])
    if cum[-1] < top_p and n < p.size:  # the head is short of the mass: sort everything
        order = np.lexsort((cand, -p))
        cum = np.cumsum(p[order])
    k = int(np.searchsorted(cum, top_p, side="left")) + 1
    sel = order[: min(k, order.size)]
    return cand[sel], p[sel]


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One index drawn from the distribution p (it need not be normalised)."""
    cdf = np.cumsum(p)
    i = int(np.searchsorted(cdf, rng.random() * cdf[-1], side="right"))
    i = min(i, p.size - 1)
    while p[i] == 0 and i > 0:  # rounding at the very top of the cdf: the last index with mass
        i -= 1
    return i


def sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
    """Greedy at temperature 0 (lowest id on ties); otherwise a draw from softmax(logits / temperature)."""
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    z -= z.max()
    p = np.exp(z)
    p /= p.sum()
    return int(rng.choice(p.size, p=p))
