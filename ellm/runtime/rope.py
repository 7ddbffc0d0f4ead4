"""The RoPE table [ctx, cos | sin], computed in float64 from the config: the one place position scaling lives."""

from __future__ import annotations

import numpy as np

from ..config import ModelConfig


def rope_table(cfg: ModelConfig, ctx: int) -> np.ndarray:
    """[ctx, rope_dim] float32: columns [0, rope_dim/2) are cos, the rest sin, of position * frequency."""
    half = cfg.rope_dim // 2
    freqs = cfg.rope_base ** (-np.arange(half, dtype=np.float64) * 2.0 / cfg.rope_dim)  # [half]
    if cfg.rope_freq_factors:
        freqs = freqs / np.asarray(cfg.rope_freq_factors, dtype=np.float64)
    positions = np.arange(ctx, dtype=np.float64)  # [ctx]
    if cfg.rope_scaling.kind == "linear":
        positions = positions / cfg.rope_scaling.factor
    angles = positions[:, None] * freqs[None, :]  # [ctx, half]
    return np.ascontiguousarray(np.concatenate([np.cos(angles), np.sin(angles)], axis=1), dtype=np.float32)
