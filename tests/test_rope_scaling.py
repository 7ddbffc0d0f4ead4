"""RoPE scaling tables against a line-by-line transcription of llama.cpp's scalar code (ggml-cpu rope_yarn)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ellm.config import ModelConfig, RopeScaling
from ellm.errors import GGUFError
from ellm.runtime.rope import rope_table


def _cfg(scaling: RopeScaling, rope_dim=64, base=100000.0, ctx_train=8192) -> ModelConfig:
    return ModelConfig("llama", 1, 576, 9, 3, 64, 64, 10, ctx_train, 1e-5, base, rope_dim, False, scaling, (), False, True)


def _ggml_table(n_dims, base, n_ctx_orig, freq_scale, ext_factor, attn_factor, beta_fast, beta_slow, positions):
    """ggml_rope_yarn_corr_dims + rope_yarn, transcribed (float64 instead of float32)."""

    def corr_dim(n_rot):
        return n_dims * math.log(n_ctx_orig / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    start = math.floor(corr_dim(beta_fast))
    end = math.ceil(corr_dim(beta_slow))
    low, high = max(0, start), min(n_dims - 1, end)
    theta_scale = base ** (-2.0 / n_dims)
    out = np.zeros((len(positions), n_dims))
    for r, p in enumerate(positions):
        theta_extrap = float(p)
        for i0 in range(0, n_dims, 2):
            theta_interp = freq_scale * theta_extrap
            theta = theta_interp
            mscale = attn_factor
            if ext_factor != 0.0:
                y = (i0 / 2 - low) / max(0.001, high - low)
                ramp_mix = (1 - min(1.0, max(0.0, y))) * ext_factor
                theta = theta_interp * (1 - ramp_mix) + theta_extrap * ramp_mix
                mscale *= 1.0 + 0.1 * math.log(1.0 / freq_scale)
            out[r, i0 // 2] = math.cos(theta) * mscale
            out[r, n_dims // 2 + i0 // 2] = math.sin(theta) * mscale
            theta_extrap *= theta_scale
    return out


@pytest.mark.parametrize("factor", [2.0, 4.0])
def test_yarn_matches_llama_cpp(factor):
    positions = [0, 1, 7, 100, 4095, 8191, 20000, 32767]
    cfg = _cfg(RopeScaling("yarn", factor, 8192))
    got = rope_table(cfg, 32768)[positions]
    want = _ggml_table(64, 100000.0, 8192, 1 / factor, 1.0, 1.0, 32.0, 1.0, positions)
    np.testing.assert_allclose(got, want, atol=2e-5 * max(1.0, max(positions) / 1e4))


def test_linear_divides_positions():
    cfg = _cfg(RopeScaling("linear", 4.0))
    plain = rope_table(_cfg(RopeScaling()), 1024)
    np.testing.assert_allclose(rope_table(cfg, 4096)[::4], plain, atol=1e-5)


def test_yarn_keeps_fast_pairs_and_interpolates_slow_ones():
    plain = rope_table(_cfg(RopeScaling()), 4096)
    yarn = rope_table(_cfg(RopeScaling("yarn", 4.0, 8192)), 4096)
    mscale = 1 + 0.1 * math.log(4.0)
    # pair 0 turns thousands of times over 8192 positions: kept; the last pairs less than once: divided by 4
    np.testing.assert_allclose(yarn[:, 0], plain[:, 0] * mscale, atol=1e-5)
    slow = plain.shape[1] // 2 - 1
    lin = rope_table(_cfg(RopeScaling("linear", 4.0)), 4096)
    np.testing.assert_allclose(yarn[:, slow], lin[:, slow] * mscale, atol=1e-5)


def test_override_and_validation():
    cfg = _cfg(RopeScaling()).with_rope_scaling("yarn", 4.0)
    assert cfg.rope_scaling.kind == "yarn" and cfg.rope_scaling.original_ctx == 8192
    assert cfg.with_rope_scaling("none", 1.0).rope_scaling == RopeScaling()
    with pytest.raises(GGUFError, match="unsupported RoPE scaling"):
        RopeScaling("ntk", 2.0)
    with pytest.raises(GGUFError, match="positive"):
        RopeScaling("linear", 0.0)
