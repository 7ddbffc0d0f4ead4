"""Run-time attention settings: validation, the kernels' argument, and the read-set arithmetic the benchmark
uses for bytes per token (checked against the selection of the NumPy model the kernels are tested against)."""

from __future__ import annotations

import numpy as np
import pytest

from ellm.bench.runner import decode_bytes_per_token
from ellm.errors import EllmError
from ellm.kv.attention import AttentionConfig
from ellm.kv.plan import KVPlan
from kvcache import sparse_keys

PLAN = KVPlan.auto(30, 3, 64, 256)


def test_validation_and_array():
    with pytest.raises(EllmError, match="attention must be"):
        AttentionConfig(mode="fast")
    with pytest.raises(EllmError, match="window"):
        AttentionConfig(window=0)
    np.testing.assert_array_equal(AttentionConfig.dense().as_array(2)[:, 2], -1)
    assert AttentionConfig(topk=7).as_array(1).tolist() == [[4, 512, 7, 8, 0]]
    per_layer = AttentionConfig(layer_topk=(3, 22, 0))
    assert per_layer.as_array(3)[:, 2].tolist() == [3, 22, 0] and per_layer.for_layer(1) == AttentionConfig()
    with pytest.raises(EllmError, match="3 layers"):
        per_layer.as_array(4)
    assert AttentionConfig.from_dict(per_layer.to_dict()) == per_layer
    assert per_layer.with_overrides((("topk", 5),)) == AttentionConfig(topk=5)  # --topk: every layer
    # bytes: a layer's blocks at its own top-K
    two = KVPlan.auto(2, 3, 64, 256)
    assert two.read_bytes(8192, AttentionConfig(layer_topk=(4, 22))) == (
        two.read_bytes(8192, AttentionConfig(topk=4), layer=0) + two.read_bytes(8192, AttentionConfig(), layer=1))


@pytest.mark.parametrize("cfg", [AttentionConfig(), AttentionConfig(sinks=0, window=100, topk=3),
                                 AttentionConfig(sinks=200, window=1000, topk=30), AttentionConfig.dense()])
def test_blocks_read_matches_the_selection(cfg):
    rng = np.random.default_rng(0)
    for t in (0, 63, 64, 600, 2047, 2048, 2111, 5000, 8191, 32767):
        keys, cand = cfg.blocks_read(t + 1, PLAN.block, PLAN.recent)
        if cfg.mode == "dense":
            assert (keys, cand) == (t + 1, 0)
            continue
        ranked = []  # the number of blocks the model ranks (the window's first block wb), if it ranks any

        def bounds_of(n):
            ranked.append(n)
            return rng.random(n)

        want = sparse_keys(PLAN, t, cfg.sinks, cfg.window, cfg.topk, bounds_of)
        sink_blocks = min(-(-cfg.sinks // PLAN.block), ranked[0]) if ranked else 0
        assert keys == len(want) and cand == (ranked[0] - sink_blocks if ranked else 0)


def test_bytes_per_token_of_a_sparse_step():
    manifest = {"targets": [{"decode_weight_bytes": 10**8}], "kv_cache": PLAN.to_dict(),
                "config": {"n_layers": 30, "n_kv_heads": 3, "head_dim": 64}}
    dense_f16 = decode_bytes_per_token(manifest, 8000, 64)
    assert decode_bytes_per_token(manifest, 8000, 64, kv_bytes_per_value=34 / 32) == 10**8 + int(23040 * 8032 * 17 / 32)
    sparse = decode_bytes_per_token(manifest, 8000, 64, AttentionConfig())
    assert dense_f16 == 10**8 + 23040 * 8032
    # (1 sink + 22 selected) blocks + the window's 512..575 keys, read as whole blocks at the plan's bytes,
    # + 2 * 64 f16 per candidate, layer and head
    keys, cand = AttentionConfig().blocks_read(8032, 64, 2)
    assert keys == 23 * 64 + 8032 - (8032 - 512) // 64 * 64 and cand == (8032 - 512) // 64 - 1
    assert sparse == int(10**8 + PLAN.bytes_per_token() * -(-keys // 64) * 64 + 256 * 90 * cand)
    assert sparse - 10**8 < 0.1 * (dense_f16 - 10**8)  # under a tenth of llama.cpp's KV traffic at 8K


def test_command_line_fields_override_the_artifacts_planned_reads(artifact):
    """`--topk` etc. replace only the fields given; with none, the engine runs the manifest's planned reads."""
    import argparse

    from ellm.cli import add_attention_args, attention_argv, attention_option, attention_overrides
    from ellm.runtime.artifact import Artifact

    p = argparse.ArgumentParser()
    add_attention_args(p)
    assert attention_option(p.parse_args([]), artifact) is None
    planned = Artifact.open(artifact).attention()
    a = p.parse_args(["--topk", "5", "--margin", "0.5"])
    assert attention_option(a, artifact) == AttentionConfig.from_dict({**planned.to_dict(), "topk": 5, "margin": 0.5})
    assert attention_overrides(p.parse_args(attention_argv(attention_overrides(a)))) == attention_overrides(a)
