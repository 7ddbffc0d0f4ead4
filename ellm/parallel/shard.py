"""Which slice of the model one tensor-parallel rank holds: its attention heads, FFN rows and vocabulary rows."""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from ..config import ModelConfig
from ..errors import EllmError

# FFN slices are cut at multiples of this many rows: they are the columns of the down projection, cut at its
# format's blocks (the widest: Q4_K and Q6_K, 256 weights). Vocabulary slices: the integer kernels' 16-row tiles.
FF_UNIT = 256
VOCAB_UNIT = 16


def _split(n: int, parts: int, unit: int = 1) -> list[tuple[int, int]]:
    """[0, n) in `parts` contiguous ranges whose sizes differ by at most one `unit` (the last takes the rest)."""
    units, rest = divmod(n, unit)
    out, start = [], 0
    for p in range(parts):
        size = (units // parts + (p < units % parts)) * unit + (rest if p == parts - 1 else 0)
        out.append((start, start + size))
        start += size
    return out


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of `world`: KV heads [kv_heads), the query heads of their groups [q_heads), FFN rows [ff)
    (gate and up rows, down columns) and vocabulary rows of the head [vocab). Embedding, norms and the residual
    stream are replicated: every rank adds the same all-reduced partial sums to the same residual."""

    rank: int
    world: int
    q_heads: tuple[int, int]
    kv_heads: tuple[int, int]
    ff: tuple[int, int]
    vocab: tuple[int, int]
    vocab_widths: tuple[int, ...]  # every rank's vocabulary rows, in rank order (the logits' all-gather)

    @classmethod
    def plan(cls, cfg: ModelConfig, rank: int, world: int) -> TensorParallel:
        """Rank `rank`'s slice: KV heads balanced by count (each rank keeps whole GQA groups), FFN and
        vocabulary rows balanced in FF_UNIT and VOCAB_UNIT steps."""
        if world < 2:
            raise EllmError(f"tensor parallelism needs at least 2 ranks, got {world}")
        if world > cfg.n_kv_heads:
            raise EllmError(f"tensor parallelism gives each rank whole KV heads: this model has {cfg.n_kv_heads}, "
                            f"too few for {world} ranks")
        if not 0 <= rank < world:
            raise EllmError(f"rank {rank} of {world}")
        if cfg.attn_bias:
            raise EllmError("tensor parallelism does not split attention biases yet (this model has them)")
        if cfg.d_ff < world * FF_UNIT:
            raise EllmError(f"tensor parallelism cuts FFN rows in steps of {FF_UNIT}: this model's d_ff "
                            f"{cfg.d_ff} does not split {world} ways")
        kv = _split(cfg.n_kv_heads, world)[rank]
        g = cfg.group_size
        vocab = _split(cfg.vocab_size, world, VOCAB_UNIT)
        return cls(rank, world, (kv[0] * g, kv[1] * g), kv, _split(cfg.d_ff, world, FF_UNIT)[rank], vocab[rank],
                   tuple(b - a for a, b in vocab))

    @property
    def n_heads(self) -> int:
        return self.q_heads[1] - self.q_heads[0]

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads[1] - self.kv_heads[0]

    @property
    def d_ff(self) -> int:
        return self.ff[1] - self.ff[0]

    def slice_config(self, cfg: ModelConfig) -> ModelConfig:
        """The hyper-parameters of the slice this rank computes (its manifest's config): its heads and FFN rows;
        the residual stream and the vocabulary (the embedding, the all-gathered logits) stay whole."""
        return replace(cfg, n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, d_ff=self.d_ff)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TensorParallel:
        return cls(int(d["rank"]), int(d["world"]), tuple(d["q_heads"]), tuple(d["kv_heads"]), tuple(d["ff"]),
                   tuple(d["vocab"]), tuple(d["vocab_widths"]))
