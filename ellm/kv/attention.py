"""Run-time attention settings: dense, or block-sparse with sinks, a local window and top-K remote blocks."""

from __future__ import annotations

import math

from dataclasses import dataclass, replace

import numpy as np

from ..errors import EllmError
from .plan import layer_runs

MODES = ("sparse", "dense")


@dataclass(frozen=True)
class AttentionConfig:
    """What a query reads (schedules/attention.py): the blocks holding the first `sinks` tokens, the
    blocks covering the last `window` tokens, and the `topk` remote blocks with the largest score bounds; then, while the best
    unread block's bound is within `margin` (in scaled-score units, i.e. nats of softmax weight) of the
    best score read, up to `widen` more blocks. Dense reads everything. `layer_topk`: a top-K per layer (a
    precision plan's read budget, precision/auto.py) in place of `topk`; empty: `topk` in every layer."""

    mode: str = "sparse"
    sinks: int = 4
    window: int = 512
    topk: int = 22  # with 64-token blocks: 64 + 512..575 + 1,408 = about 2K tokens per query
    widen: int = 8
    margin: float = 0.0
    layer_topk: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise EllmError(f"attention must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.sinks < 0 or self.window < 1 or self.topk < 0 or self.widen < 0 or min(self.layer_topk, default=0) < 0:
            raise EllmError("attention: sinks, topk and widen must be >= 0 and window >= 1")
        if not (isinstance(self.margin, (int, float)) and math.isfinite(self.margin) and self.margin >= 0):
            raise EllmError(f"attention: margin must be a finite number >= 0, got {self.margin}")

    def for_layer(self, layer: int) -> AttentionConfig:
        """The settings layer `layer` reads with (its own top-K where there is one per layer)."""
        if not self.layer_topk:
            return self
        if not 0 <= layer < len(self.layer_topk):
            raise EllmError(f"attention: no top-K for layer {layer} (the settings have {len(self.layer_topk)} layers)")
        return replace(self, topk=self.layer_topk[layer], layer_topk=())

    @classmethod
    def dense(cls) -> AttentionConfig:
        return cls(mode="dense")

    def as_array(self, n_layers: int) -> np.ndarray:
        """The kernels' float32[n_layers, 5]: per layer sinks, window, topk (-1: dense), widen, margin."""
        if self.layer_topk and len(self.layer_topk) != n_layers:
            raise EllmError(f"attention: a top-K for {len(self.layer_topk)} layers, the model has {n_layers}")
        rows = []
        for i in range(n_layers):
            c = self.for_layer(i)
            rows.append([c.sinks, c.window, -1 if c.mode == "dense" else c.topk, c.widen, c.margin])
        return np.array(rows, np.float32)

    def blocks_read(self, n_ctx: int, block: int, recent: int) -> tuple[int, int]:
        """(keys read, candidate blocks whose bounds are computed) by a query at position n_ctx - 1, as
        schedules/attention.py's _Shape chooses them (before any widening)."""
        if self.mode == "dense":
            return n_ctx, 0
        wb = max(n_ctx - max(self.window, recent * block), 0) // block
        sb = min(-(-self.sinks // block), wb)
        if wb - sb <= self.topk:
            return n_ctx, 0
        return (sb + self.topk) * block + n_ctx - wb * block, wb - sb

    def reads_first(self, n_ctx: int, block: int, recent: int) -> bool:
        """Whether that query reads block 0 (always, unless top-K selection could pass it over)."""
        return self.mode == "dense" or self.sinks > 0 or self.blocks_read(n_ctx, block, recent)[1] == 0

    def to_dict(self) -> dict:
        d = {"mode": self.mode, "sinks": self.sinks, "window": self.window, "topk": self.topk, "widen": self.widen,
             "margin": self.margin}
        return d | ({"layer_topk": list(self.layer_topk)} if self.layer_topk else {})

    @classmethod
    def from_dict(cls, d: dict) -> AttentionConfig:
        """A manifest's entry; fields it lacks keep their defaults."""
        known = cls().to_dict()
        kw = {k: type(known[k])(v) for k, v in d.items() if k in known}
        return cls(**kw, layer_topk=tuple(int(k) for k in d.get("layer_topk", ())))

    def with_overrides(self, over) -> AttentionConfig:
        """This config with (field, value) pairs replaced (validated again); a top-K given replaces the
        per-layer ones too."""
        over = dict(over)
        return replace(self, **over, **({"layer_topk": ()} if "topk" in over else {}))

    def describe(self) -> str:
        if self.mode == "dense":
            return "attention dense"
        topk = f"top-{self.topk}" if not self.layer_topk else f"top-K per layer {layer_runs(self.layer_topk)}"
        return f"attention sparse (sinks {self.sinks}, window {self.window}, {topk} blocks, widen <= {self.widen})"

