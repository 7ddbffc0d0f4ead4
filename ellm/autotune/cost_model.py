"""A learned cost model: gradient-boosted trees (XGBoost) predicting a candidate's log time from its features
(knob values and TIR features, features.py), trained online as trials arrive.

Times are learnt relative to the fastest of their own kernel (log of seconds / best), so records of other
kernels or other CPUs (`prior`) teach the shape of the landscape, not its scale: a new search starts from
them and its own trials weigh more as they accumulate.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class CostModel:
    def __init__(self, seed: int = 0, rounds: int = 60, prior: Sequence[tuple[Sequence[float], float]] = ()):
        """`prior`: (features, log time relative to its kernel's best) of earlier records."""
        self.seed, self.rounds = seed, rounds
        self.prior = [(list(f), float(y)) for f, y in prior]
        self._booster = None

    @property
    def trained(self) -> bool:
        return self._booster is not None

    def fit(self, X: Sequence[Sequence[float]], log_seconds: Sequence[float]) -> None:
        """Refit on this kernel's trials (features, log seconds) and the prior."""
        import xgboost as xgb

        y = np.asarray(log_seconds, np.float64)
        if len(y) < 2 and not self.prior:
            return
        y = y - y.min()
        rows = [list(x) for x in X]
        weights = [1.0] * len(rows)
        if self.prior:
            w_prior = max(0.2, 1.0 - len(rows) / 32)  # the prior fades as own trials come in
            rows += [f for f, _ in self.prior]
            y = np.concatenate([y, [t for _, t in self.prior]])
            weights += [w_prior] * len(self.prior)
        width = max(len(r) for r in rows)
        data = np.array([r + [0.0] * (width - len(r)) for r in rows], np.float32)
        dm = xgb.DMatrix(data, label=y, weight=np.asarray(weights, np.float32))
        params = {"max_depth": 4, "eta": 0.2, "subsample": 0.9, "min_child_weight": 1.0, "objective": "reg:squarederror",
                  "seed": self.seed, "nthread": 1, "verbosity": 0}
        self._booster = xgb.train(params, dm, num_boost_round=self.rounds)
        self._width = width

    def predict(self, X: Sequence[Sequence[float]]) -> np.ndarray:
        """Predicted log time relative to the best (lower is faster)."""
        import xgboost as xgb

        rows = [list(x)[: self._width] + [0.0] * max(0, self._width - len(x)) for x in X]
        return self._booster.predict(xgb.DMatrix(np.array(rows, np.float32)))


def relative_log_times(results: Sequence[tuple[Sequence[float], float]]) -> list[tuple[list[float], float]]:
    """(features, seconds) of one kernel as prior records: (features, log(seconds / fastest))."""
    ok = [(list(f), s) for f, s in results if s and s > 0]
    if not ok:
        return []
    best = min(s for _, s in ok)
    return [(f, float(np.log(s / best))) for f, s in ok]


__all__ = ["CostModel", "relative_log_times"]
