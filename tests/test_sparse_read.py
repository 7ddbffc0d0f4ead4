"""The float model's block-sparse selection (precision/sparse_read.py) against its definition: score bounds
that bound, the sink, window and top-K blocks by bound, dense below the candidate count, widening by margin."""

import numpy as np
import pytest

from ellm.kv.attention import AttentionConfig
from ellm.precision.kv_read import hadamard
from ellm.precision.sparse_read import SparseSelect

B, HKV, G, HD = 16, 2, 3, 16


def _case(n: int, c: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    keys = rng.normal(size=(n, HKV, HD)).astype(np.float32)
    keys[::7] *= 3  # some blocks stand out
    q = rng.normal(size=(HKV, G, c, HD)).astype(np.float32) / 4
    scores = np.einsum("hgcd,nhd->hgcn", q, keys)
    return q, keys, scores


@pytest.mark.parametrize("rotate", [False, True])
def test_bounds_bound_every_score_of_their_block(rotate):
    q, keys, scores = _case(8 * B, 4)
    bound = SparseSelect(AttentionConfig(), B, rotate=rotate)._bounds(q, keys)  # [Hkv, c, NB]
    best = scores.reshape(HKV, G, 4, 8, B).max(axis=(1, 4))  # over the G heads and the block's keys
    assert (bound >= best - 1e-4).all()
    if rotate:  # the range is taken in the Hadamard basis: a different bound, still a bound
        assert not np.allclose(bound, SparseSelect(AttentionConfig(), B)._bounds(q, keys))
        assert np.allclose(hadamard(HD) @ hadamard(HD), np.eye(HD), atol=1e-6)


def test_reads_sinks_window_and_the_top_k_bounds():
    n, c = 20 * B, 1  # one query at the last position: block 19 is its own
    q, keys, scores = _case(n, c, seed=1)
    cfg = AttentionConfig(sinks=B, window=3 * B, topk=4, widen=0)
    sel = SparseSelect(cfg, B, recent=2)
    mask = sel(q, keys, scores, n - c)  # [Hkv, 1, c, n]
    read = (mask[:, 0, 0].reshape(HKV, 20, B) == 0).all(axis=-1)  # whole blocks
    assert ((mask == 0) | (mask == -np.inf)).all()
    bound = sel._bounds(q, keys)[:, 0]  # [Hkv, NB]
    wb = (n - 3 * B) // B  # 17: the window is blocks 17..19
    for h in range(HKV):
        cand = np.arange(1, wb)
        top = set(cand[np.argsort(-bound[h, cand], kind="stable")[:4]])
        assert set(np.flatnonzero(read[h])) == {0} | top | set(range(wb, 20))


def test_dense_when_the_candidates_fit_and_in_dense_mode():
    n, c = 10 * B, B
    q, keys, scores = _case(n, c, seed=2)
    for cfg in (AttentionConfig(window=3 * B, topk=8), AttentionConfig.dense()):
        assert (SparseSelect(cfg, B)(q, keys, scores, n - c) == 0).all()


def test_widening_follows_the_margin():
    n, c = 24 * B, 1  # the last position: its window is exactly 2 blocks
    q, keys, scores = _case(n, c, seed=3)

    def blocks(margin: float, widen: int = 5) -> np.ndarray:
        cfg = AttentionConfig(sinks=0, window=2 * B, topk=3, widen=widen, margin=margin)
        m = SparseSelect(cfg, B)(q, keys, scores, n - c)
        return (m[:, 0].reshape(HKV, c, 24, B) == 0).all(axis=-1).sum(axis=-1)  # [Hkv, c]

    # no margin can widen past `widen`, and widen 0 never widens (a negative margin is refused: test_errors.py)
    assert (blocks(1e9) == 3 + 5 + 2).all() and (blocks(1e9, widen=0) == 3 + 2).all()
    mid = blocks(0.0)
    assert ((mid >= 5) & (mid <= 10)).all()


def test_agrees_with_the_kernels_numpy_model():
    """The read set per query is the one tests/kvcache.py's sparse_keys (the kernels' tested model) gives for the
    same bounds, at every position of a chunk, sparse and dense alike."""
    from ellm.kv.plan import KVPlan
    from kvcache import sparse_keys

    bk = 32  # the smallest block a plan takes
    plan = KVPlan.auto(1, HKV, 32, 64, block=bk)  # sparse_keys reads only its block and recent tier
    n, c = 30 * bk, 2 * bk
    q, keys, scores = _case(n, c, seed=4)
    cfg = AttentionConfig(sinks=4, window=5 * bk, topk=6, widen=0)
    sel = SparseSelect(cfg, bk, recent=plan.recent)
    mask = sel(q, keys, scores, n - c)
    for i in (0, 7, bk - 1, bk, c - 1):
        t = n - c + i
        bound = sel._bounds(q[:, :, i : i + 1], keys[: t + 1])[:, 0]  # [Hkv, NB] of this query
        for h in range(HKV):
            want = sparse_keys(plan, t, cfg.sinks, cfg.window, cfg.topk, lambda nb, h=h: bound[h, :nb])
            got = np.flatnonzero(mask[h, 0, i, : t + 1] == 0)
            np.testing.assert_array_equal(got, want)
