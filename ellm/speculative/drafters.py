"""Where drafted tokens come from: prompt lookup (ngram), a draft model with its own KV cache (model), or
prompt lookup first and the draft model where nothing matches (cascade).

A drafter follows the committed text (the prompt and every token chosen since, the pending one included)
through `append`. Each step the loop asks it what it could draft (`offer`: the kind of draft, for the
controller's acceptance statistics, and how many tokens), lets the controller choose a length k, then takes
the k tokens (`take`) with the drafter's probabilities where it has them (for speculative sampling).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Hashable, Sequence

import numpy as np

from .accept import probabilities
from .ngram import NgramIndex

if TYPE_CHECKING:
    from ..runtime.engine import Engine
    from .config import SpeculativeConfig
    from .controller import ChainController

MODEL_KEY = ("model",)
# While the controller has backed off a draft model, the model catches up on the committed text every
# PROBE_EVERY tokens in one multi-token step whose rows check what it would have drafted (shadow checks).
# Each probe in a row that does not win the model back doubles the interval, up to PROBE_MAX: a probe costs
# a draft step of up to 16 rows (a 26-of-30-layer SmolLM2 self-draft probing every 16 tokens cost ~12%).
# A draft model too slow to pay even if every drafted token were accepted is not probed at all.
PROBE_EVERY, PROBE_MAX = 16, 256


class NgramDrafter:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the text's longest suffix."""

    def __init__(self, cfg: SpeculativeConfig, context: Sequence[int]):
        self.index = NgramIndex(cfg.ngram_max, cfg.ngram_min, context)
        self._draft: list[int] = []
        self.draft_s = 0.0  # lookups cost nothing worth counting
        self.cost_prior = 0.0

    def append(self, token: int) -> None:
        self.index.append(token)

    def offer(self, room: int) -> tuple[Hashable, int]:
        self._draft, matched = self.index.propose(room) if room > 0 else ([], 0)
        return ("ngram", matched), len(self._draft)

    def take(self, k: int, temperature: float, rng: np.random.Generator) -> tuple[list[int], np.ndarray | None]:
        return self._draft[:k], None  # a point mass: q(x) = 1 for the drafted token

    def declined(self, controller: ChainController, key: Hashable, chosen: int) -> None:
        """The controller decoded one token instead of verifying the offer: was the offer's first token it?"""
        if self._draft:
            controller.shadow(key, self._draft[0] == chosen)


class ModelDrafter:
    """A draft artifact (same vocabulary) run by its own engine and KV cache. Before drafting, the draft
    catches up on the committed tokens it has not seen in one multi-token step (its verify entry, or prefill
    for a long backlog such as the prompt), after rolling back whatever it drafted that was not accepted;
    then it drafts one token per one-token step."""

    def __init__(self, draft: Engine, context: Sequence[int], target: Engine):
        self.eng = draft
        # a drafted token's cost over a decode step of the target's, before any is measured: both steps are
        # bound by the weights they stream
        self.cost_prior = (draft.artifact.target["decode_weight_bytes"] / target.artifact.target["decode_weight_bytes"])
        self.tokens: list[int] = list(context)
        self._synced = 0  # leading committed tokens known to be in the draft's cache
        self._probe_every = PROBE_EVERY
        self.draft_s = 0.0  # seconds spent in the draft model (catch-up and drafting)

    def append(self, token: int) -> None:
        self.tokens.append(int(token))

    def start(self) -> None:
        """Read the prompt (all but its last token, which the first draft step runs), reusing the draft's
        cache of an earlier turn."""
        eng, last = self.eng, len(self.tokens) - 1
        keep = min(eng.common_prefix(self.tokens), last)
        eng.truncate(keep)
        if keep < last:
            eng.prefill(self.tokens[keep:last])
        self._synced = last

    def offer(self, room: int) -> tuple[Hashable, int]:
        return MODEL_KEY, max(room, 0)

    def _catch_up(self, controller: ChainController | None = None) -> np.ndarray:
        """Bring the draft's cache to every committed token but the last, run the last; its logits [vocab].
        With `controller`: each fed token is checked against the draft's prediction of it (shadow checks)."""
        eng = self.eng
        common = min(eng.common_prefix(self.tokens, self._synced), len(self.tokens) - 1)
        eng.truncate(common)
        rest = self.tokens[common:]
        if len(rest) > eng.max_verify:
            logits = eng.prefill(rest)
        else:
            rows = eng.verify(rest)
            if controller is not None:
                for row, actual in zip(rows[:-1], rest[1:]):
                    controller.shadow(MODEL_KEY, int(np.argmax(row)) == actual)
            logits = rows[-1]
        self._synced = len(self.tokens)
        return logits

    def take(self, k: int, temperature: float, rng: np.random.Generator) -> tuple[list[int], np.ndarray | None]:
        t = time.perf_counter()
        self._probe_every = PROBE_EVERY
        logits = self._catch_up()
        out: list[int] = []
        q = [] if temperature > 0 else None
        for i in range(k):
            if q is None:
                x = int(np.argmax(logits))
            else:
                p = probabilities(logits, temperature)
                x = int(rng.choice(p.size, p=p))
                q.append(p)
            out.append(x)
            if i + 1 < k:
                logits = self.eng.decode(x)
        self.draft_s += time.perf_counter() - t
        return out, (np.stack(q) if q else None)

    def declined(self, controller: ChainController, key: Hashable, chosen: int) -> None:
        if len(self.tokens) - self._synced >= self._probe_every and controller.could_pay():
            t = time.perf_counter()
            self._catch_up(controller)
            self.draft_s += time.perf_counter() - t
            self._probe_every = min(2 * self._probe_every, PROBE_MAX)


class CascadeDrafter:
    """Prompt lookup where the text's suffix occurred before, the draft model elsewhere."""

    def __init__(self, ngram: NgramDrafter, model: ModelDrafter):
        self.ngram, self.model = ngram, model
        self._using: NgramDrafter | ModelDrafter = ngram
        self.cost_prior = model.cost_prior

    @property
    def draft_s(self) -> float:
        return self.model.draft_s

    def append(self, token: int) -> None:
        self.ngram.append(token)
        self.model.append(token)

    def offer(self, room: int) -> tuple[Hashable, int]:
        key, n = self.ngram.offer(room)
        self._using = self.ngram if n else self.model
        return (key, n) if n else self.model.offer(room)

    def take(self, k: int, temperature: float, rng: np.random.Generator) -> tuple[list[int], np.ndarray | None]:
        return self._using.take(k, temperature, rng)

    def declined(self, controller: ChainController, key: Hashable, chosen: int) -> None:
        self._using.declined(controller, key, chosen)
