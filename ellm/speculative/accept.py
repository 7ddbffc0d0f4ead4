"""Which drafted tokens a verification step accepts, and the token that follows them.

Greedy: a drafted token is accepted while it is the target's argmax (lowest id on ties, as plain decoding
chooses). Sampling (Leviathan et al. 2023, Chen et al. 2023): drafted token x_i, drawn from the drafter's
q_i, is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first rejection the next token is
drawn from the residual max(0, p_i - q_i), renormalised, and after a fully accepted chain from the last
row's p. The output is distributed exactly as sampling from p token by token. A drafter without a
distribution (prompt lookup) is a point mass: q_i(x_i) = 1, so x_i is accepted with probability p_i(x_i)
and the residual is p_i without x_i.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def probabilities(logits: np.ndarray, temperature: float) -> np.ndarray:
    """softmax(logits / temperature) in float64, rows independent ([..., vocab])."""
    z = logits.astype(np.float64) / temperature
    z -= z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    return p / p.sum(axis=-1, keepdims=True)


def accept_greedy(rows: np.ndarray, draft: Sequence[int]) -> tuple[int, int]:
    """rows [len(draft) + 1, vocab]: the target's logits after the token before the chain and after each
    drafted token. (accepted count, next token)."""
    best = np.argmax(rows, axis=-1)
    n = 0
    while n < len(draft) and int(best[n]) == int(draft[n]):
        n += 1
    return n, int(best[n])


def accept_sampled(p: np.ndarray, draft: Sequence[int], rng: np.random.Generator,
                   q: np.ndarray | None = None) -> tuple[int, int]:
    """As accept_greedy, sampling. `p` [len(draft) + 1, vocab]: the target's distributions at each row (the
    sampler's, runtime/sampling.py); `q` [len(draft), vocab]: the drafter's at each drafted position (None:
    point masses on the drafted tokens)."""
    for i, x in enumerate(draft):
        x = int(x)
        qx = 1.0 if q is None else float(q[i, x])
        if qx > 0 and rng.random() < min(1.0, p[i, x] / qx):
            continue
        if q is None:
            residual = p[i].copy()
            residual[x] = 0.0
        else:
            residual = np.maximum(p[i] - q[i], 0.0)
        total = residual.sum()
        # a residual of zero means p = q (or p is a point mass on x): the rejection had probability 0
        nxt = int(rng.choice(p.shape[1], p=residual / total)) if total > 0 else int(rng.choice(p.shape[1], p=p[i]))
        return i, nxt
    return len(draft), int(rng.choice(p.shape[1], p=p[len(draft)]))
