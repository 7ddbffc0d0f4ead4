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
    rs = cfg.rope_scaling
    mscale = 1.0
    if rs.kind == "linear":
        freqs = freqs / rs.factor
    elif rs.kind == "yarn":
        freqs, mscale = _yarn(freqs, cfg.rope_dim, cfg.rope_base, rs.original_ctx or cfg.ctx_train, rs)
    angles = positions[:, None] * freqs[None, :]  # [ctx, half]
    table = np.concatenate([np.cos(angles), np.sin(angles)], axis=1) * mscale
    return np.ascontiguousarray(table, dtype=np.float32)


def _yarn(freqs: np.ndarray, rope_dim: int, base: float, original_ctx: int, rs) -> tuple[np.ndarray, float]:
    """YaRN frequencies [half] and magnitude scale, following llama.cpp's ggml_rope_yarn_corr_dims / rope_yarn."""

    def corr_dim(n_rot: float) -> float:  # the pair index whose wavelength fits n_rot times in original_ctx
        return rope_dim * np.log(original_ctx / (n_rot * 2 * np.pi)) / (2 * np.log(base))

    low = max(0.0, np.floor(corr_dim(rs.beta_fast)))
    high = min(rope_dim - 1.0, np.ceil(corr_dim(rs.beta_slow)))
    i = np.arange(len(freqs), dtype=np.float64)
    ramp = 1.0 - np.clip((i - low) / max(0.001, high - low), 0.0, 1.0)  # 1: keep (extrapolate), 0: interpolate
    mixed = freqs / rs.factor * (1.0 - ramp) + freqs * ramp
    return mixed, rs.attn_factor * (1.0 + 0.1 * np.log(rs.factor))
