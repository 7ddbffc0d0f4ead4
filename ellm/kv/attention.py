"""Run-time attention settings: dense, or block-sparse with sinks, a local window and top-K remote blocks."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import EllmError

MODES = ("sparse", "dense")


@dataclass(frozen=True)
class AttentionConfig:
    """What a query reads (schedules/attention.py): the blocks holding the first `sinks` tokens, the
    blocks covering the last `window` tokens, and the `topk` remote blocks with the largest score bounds; then, while the best
    unread block's bound is within `margin` (in scaled-score units, i.e. nats of softmax weight) of the
    best score read, up to `widen` more blocks. Dense reads everything."""

    mode: str = "sparse"
    sinks: int = 4
    window: int = 512
    topk: int = 22  # with 64-token blocks: 64 + 512..575 + 1,408 = about 2K tokens per query
    widen: int = 8
    margin: float = 0.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise EllmError(f"attention must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.sinks < 0 or self.window < 1 or self.topk < 0 or self.widen < 0:
            raise EllmError("attention: sinks, topk and widen must be >= 0 and window >= 1")

    @classmethod
    def dense(cls) -> AttentionConfig:
        return cls(mode="dense")

    def as_array(self) -> np.ndarray:
        """The kernels' float32[5]: sinks, window, topk (-1: dense), widen, margin."""
        topk = -1 if self.mode == "dense" else self.topk
        return np.array([self.sinks, self.window, topk, self.widen, self.margin], np.float32)

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
        return {"mode": self.mode, "sinks": self.sinks, "window": self.window, "topk": self.topk, "widen": self.widen,
                "margin": self.margin}

    @classmethod
    def from_dict(cls, d: dict) -> AttentionConfig:
        """A manifest's entry; fields it lacks keep their defaults."""
        known = cls().to_dict()
        return cls(**{k: type(known[k])(v) for k, v in d.items() if k in known})

    def with_overrides(self, over) -> AttentionConfig:
        """This config with (field, value) pairs replaced (validated again)."""
        from dataclasses import replace

        return replace(self, **dict(over))

    def describe(self) -> str:
        if self.mode == "dense":
            return "attention dense"
        return f"attention sparse (sinks {self.sinks}, window {self.window}, top-{self.topk} blocks, widen <= {self.widen})"
