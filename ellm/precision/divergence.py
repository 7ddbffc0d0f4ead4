"""KL divergence of next-token distributions from a fixed reference, precise for the tiny divergences of
lowering one part.

With d = z_ref - z (logit differences, small), KL(P_ref || Q) = E_p[d] + log E_p[exp(-d)]: computed from d
alone it never subtracts two log-partition functions of size ~10 in float32 (which would bury a KL of 1e-5 in
rounding). The reference's probabilities are kept as float32 [positions, vocab].
"""

from __future__ import annotations

import numpy as np


class Reference:
    def __init__(self, logits: np.ndarray, rows: int = 64):
        """`logits` [n, vocab] of the unmodified model."""
        self.z = np.ascontiguousarray(logits, dtype=np.float32)
        self.rows = rows
        self.p = np.empty_like(self.z)
        for s in range(0, len(self.z), rows):  # in row blocks: no [n, vocab] float64 temporaries
            z = self.z[s : s + rows].astype(np.float64)
            e = np.exp(z - z.max(axis=1, keepdims=True))
            self.p[s : s + rows] = e / e.sum(axis=1, keepdims=True)

    def __len__(self) -> int:
        return len(self.z)

    def kl(self, logits: np.ndarray) -> np.ndarray:
        """Per-position KL(reference || softmax(logits)) in nats, [n] float64."""
        out = np.empty(len(self.z))
        for s in range(0, len(self.z), self.rows):
            d = self.z[s : s + self.rows] - logits[s : s + self.rows]  # [r, vocab] float32
            p = self.p[s : s + self.rows]
            # float32 pairwise sums of terms of size |d|: errors ~1e-7 |d|, far below the KL (~d^2 / 2)
            mean = (p * d).sum(axis=1, dtype=np.float64)
            np.negative(d, out=d)
            np.expm1(d, out=d)
            # log E_p[e^-d] = log1p(E_p[expm1(-d)]), precise when d is small
            out[s : s + self.rows] = mean + np.log1p((p * d).sum(axis=1, dtype=np.float64))
        return np.maximum(out, 0.0)

    def top1_agree(self, logits: np.ndarray) -> float:
        return float((self.z.argmax(axis=1) == logits.argmax(axis=1)).mean())
