"""How many drafted tokens to verify: the length that maximises expected tokens per unit of step cost,
from the measured acceptance of each kind of draft and the measured cost of verifying k tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Sequence

# Acceptance counts decay by this factor per observation, so the estimate follows the text (a quoted passage
# ends, an open answer begins). The prior is one success in four trials, counted as a first observation that
# decays like the others: not worth a verification step until the free shadow checks of unverified drafts
# (ChainController.shadow) show the drafts hit (in open-ended answers, SmolLM2 2K/8K, a prior of one in two
# cost 6-9% of decode speed in verification steps that failed), and no cap on the rate once they keep hitting
# (held fixed, it capped a copied passage's rate at 0.93 and its chains at 4 drafted tokens: replaying the
# bench's greedy outputs through the controller, the decaying prior gained 0-9% on the grounded tasks).
DECAY = 0.9
PRIOR_SUCCESS, PRIOR_TRIALS = 1.0, 4.0
# How fast the measured verification costs move the cost curve's slope.
COST_RATE = 0.2


@dataclass
class _Acceptance:
    success: float = PRIOR_SUCCESS
    trials: float = PRIOR_TRIALS

    def add(self, success: float, trials: float) -> None:
        self.success = self.success * DECAY + success
        self.trials = self.trials * DECAY + trials

    @property
    def rate(self) -> float:
        return self.success / self.trials


@dataclass
class ChainController:
    """`curve[k]`: the cost of a verification step of k drafted tokens (k + 1 rows) over a one-token decode
    step, k = 0 .. max_chain (curve[0] = 1), as measured once per artifact and machine (cost.py). At run
    time the measured step times rescale the curve's slope: verification grows costlier with context as
    attention's share of the step grows.

    Acceptance is tracked per draft kind (`key`: e.g. the n-gram match length), as a per-token rate alpha
    under a geometric model: a chain of k tokens yields 1 + alpha + ... + alpha^k tokens per step."""

    curve: Sequence[float]
    max_chain: int
    adaptive: bool = True
    slope: float = 1.0
    _acc: dict[Hashable, _Acceptance] = field(default_factory=dict)
    # a draft model's cost per drafted token over a decode step's: a prior (the weight bytes it streams over
    # the target's), then as measured
    draft_cost: float = 0.0
    _decode_s: float | None = None

    def __post_init__(self) -> None:
        if len(self.curve) < self.max_chain + 1 or self.curve[0] != 1.0:
            raise ValueError("the cost curve needs curve[0] = 1 and one value per chain length up to max_chain")

    def rate(self, key: Hashable) -> float:
        return self._acc.setdefault(key, _Acceptance()).rate

    def cost(self, k: int, drafted: bool = False) -> float:
        """A step verifying k drafted tokens, over a decode step; `drafted`: with a draft model's cost of
        drafting them."""
        return 1.0 + self.slope * (self.curve[k] - 1.0) + (k * self.draft_cost if drafted else 0.0)

    def length(self, key: Hashable, available: int, drafted: bool = False) -> int:
        """Drafted tokens to verify, of `available` (0: decode one token instead). `drafted`: the draft is yet
        to be computed by a draft model, at `draft_cost` per token."""
        top = min(available, self.max_chain)
        if not self.adaptive or top == 0:
            return top
        alpha = self.rate(key)
        best, best_value, expected = 0, 1.0, 1.0
        for k in range(1, top + 1):
            expected += alpha ** k
            value = expected / self.cost(k, drafted)
            if value > best_value:
                best, best_value = k, value
        return best

    def could_pay(self, margin: float = 1.1) -> bool:
        """Whether a draft model at the measured `draft_cost` would pay even if every drafted token were
        accepted (expected tokens per unit of cost above `margin` for some chain length)."""
        return any((k + 1) / self.cost(k, drafted=True) > margin for k in range(1, self.max_chain + 1))

    def accepted(self, key: Hashable, k: int, n: int) -> None:
        """A verification of k drafted tokens accepted the first n (n + 1 trials, or k when all passed)."""
        self._acc.setdefault(key, _Acceptance()).add(n, min(n + 1, k))

    def shadow(self, key: Hashable, hit: bool) -> None:
        """A draft that was not verified, compared with the token decoding chose instead (no cost): keeps the
        estimate alive where the controller has backed off."""
        self._acc.setdefault(key, _Acceptance()).add(float(hit), 1.0)

    def timed_draft(self, k: int, seconds: float) -> None:
        """A draft model's k drafted tokens took `seconds` (its catch-up on the committed text included)."""
        if self._decode_s is not None and k > 0:
            seen = seconds / k / self._decode_s
            self.draft_cost = seen if self.draft_cost == 0.0 else 0.7 * self.draft_cost + 0.3 * seen

    def timed(self, k: int, seconds: float) -> None:
        """A step's measured time: k = 0 a decode step, else a verification of k drafted tokens."""
        if k == 0:
            self._decode_s = seconds if self._decode_s is None else 0.8 * self._decode_s + 0.2 * seconds
            return
        if self._decode_s is None:
            self._decode_s = seconds / self.cost(k)  # no decode step timed yet: what the curve implies
            return
        if self.curve[k] <= 1.0:
            return
        seen = (seconds / self._decode_s - 1.0) / (self.curve[k] - 1.0)
        self.slope += COST_RATE * (min(max(seen, 0.25), 4.0) - self.slope)
