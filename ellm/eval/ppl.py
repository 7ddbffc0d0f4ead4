"""Perplexity of a long text, and the KL divergence of each next-token distribution from a reference engine's."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    """[n, vocab] float32 logits -> float64 log-probabilities."""
    x = logits.astype(np.float64)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


@dataclass(frozen=True)
class PplResult:
    tokens: int  # tokens scored (the first is context only)
    nll: float  # mean negative log-likelihood per scored token (nats)
    kl_mean: float | None  # mean KL(reference || this) per position (nats), with a reference
    kl_max: float | None
    top1_agree: float | None  # fraction of positions whose argmax equals the reference's
    ref_nll: float | None

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    @property
    def ref_ppl(self) -> float | None:
        return math.exp(self.ref_nll) if self.ref_nll is not None else None

    def to_dict(self) -> dict:
        return {"tokens": self.tokens, "nll": self.nll, "ppl": self.ppl, "kl_mean": self.kl_mean,
                "kl_max": self.kl_max, "top1_agree": self.top1_agree, "ref_nll": self.ref_nll, "ref_ppl": self.ref_ppl}


def perplexity(eng, ids: list[int], reference=None, chunk: int | None = None, progress=None) -> PplResult:
    """Teacher-forced over `ids` from an empty cache, in prefill chunks (memory stays bounded: one chunk of
    logits at a time). With `reference` (another engine), both run chunk by chunk in step."""
    if len(ids) < 2:
        raise ValueError("perplexity needs at least two tokens")
    if reference is eng:
        raise ValueError("the reference must be a separate engine (each engine owns one KV cache)")
    chunk = chunk or eng.prefill_chunk
    engines = [eng] + ([reference] if reference is not None else [])
    for e in engines:
        e.reset()
    nll = ref_nll = 0.0
    kl_sum, kl_max, agree = 0.0, 0.0, 0
    n = 0
    for start in range(0, len(ids), chunk):
        piece = ids[start : start + chunk]
        lps = [_log_softmax(e.prefill(piece, all_logits=True)) for e in engines]  # [len(piece), vocab] each
        nxt = np.asarray(ids[start + 1 : start + 1 + len(piece)])  # the tokens these positions predict
        m = len(nxt)
        if m == 0:
            break
        rows = np.arange(m)
        nll -= lps[0][rows, nxt].sum()
        if reference is not None:
            lp, lr = lps[0][:m], lps[1][:m]
            ref_nll -= lr[rows, nxt].sum()
            kl = (np.exp(lr) * (lr - lp)).sum(axis=1)  # KL(reference || this) per position
            kl_sum += kl.sum()
            kl_max = max(kl_max, float(kl.max()))
            agree += int((lp.argmax(axis=1) == lr.argmax(axis=1)).sum())
        n += m
        if progress:
            progress(start + len(piece), len(ids))
    has_ref = reference is not None
    return PplResult(
        tokens=n,
        nll=nll / n,
        kl_mean=kl_sum / n if has_ref else None,
        kl_max=kl_max if has_ref else None,
        top1_agree=agree / n if has_ref else None,
        ref_nll=ref_nll / n if has_ref else None,
    )
