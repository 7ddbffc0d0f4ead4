"""Speculative chains without a model: prompt lookup, the acceptance rules, the chain-length controller."""

from __future__ import annotations

import numpy as np
import pytest

from ellm.errors import EllmError
from ellm.speculative import ChainController, NgramIndex, SpeculativeConfig, accept_greedy, accept_sampled
from ellm.speculative.accept import probabilities


def _lookup_by_scan(seq: list[int], k: int, n_max: int, n_min: int) -> tuple[list[int], int]:
    """The reference: the latest earlier occurrence of the longest suffix, found by scanning."""
    for n in range(min(n_max, len(seq)), n_min - 1, -1):
        suffix = seq[len(seq) - n :]
        for start in range(len(seq) - n - 1, -1, -1):
            if seq[start : start + n] == suffix:
                return seq[start + n : start + n + k], n
    return [], 0


def test_ngram_index_equals_a_rescan_at_every_length():
    rng = np.random.default_rng(0)
    seq = rng.integers(0, 6, 400).tolist()  # a small alphabet: many repeats of every length
    index = NgramIndex(n_max=4, n_min=1)
    for i, t in enumerate(seq):
        index.append(t)
        assert index.propose(5) == _lookup_by_scan(seq[: i + 1], 5, 4, 1), i


def test_ngram_index_prefers_the_longest_match_and_copies_what_followed():
    index = NgramIndex(n_max=3, n_min=1, tokens=[1, 2, 3, 9, 9, 2, 3, 7, 8, 1, 2, 3])
    # "1 2 3" occurred at the start followed by 9 9 2; "2 3" more recently followed by 7 8
    assert index.propose(3) == ([9, 9, 2], 3)
    index.truncate(11)  # ... 1 2
    assert index.propose(2) == ([3, 9], 2)
    assert NgramIndex(tokens=[5, 6, 7]).propose(4) == ([], 0)


def test_ngram_lookups_cost_the_same_at_any_length():
    short, long_ = NgramIndex(), NgramIndex(tokens=list(range(200_000)) * 1)
    for idx in (short, long_):
        idx.extend([1, 2, 3, 4, 1, 2, 3])
    # a dictionary probe per length tried, never a pass over the sequence
    assert long_.propose(4) == ([4, 1, 2, 3], 3)
    assert len(long_._next) <= 4 * len(long_)


def test_greedy_acceptance_stops_at_the_first_disagreement():
    rows = np.zeros((4, 10), np.float32)
    for i, best in enumerate([3, 5, 7, 2]):
        rows[i, best] = 1.0
    assert accept_greedy(rows, [3, 5, 7]) == (3, 2)
    assert accept_greedy(rows, [3, 4, 7]) == (1, 5)
    assert accept_greedy(rows, [0, 5, 7]) == (0, 3)
    rows[1, 4] = 1.0  # a tie: the lowest id, as plain greedy decoding
    assert accept_greedy(rows, [3, 4, 7]) == (3, 2)


def _first_token_distribution(p_rows, draft, q, n, seed):
    """Empirical distribution of the first token a verification emits: the drafted token if accepted, else
    the residual draw."""
    rng = np.random.default_rng(seed)
    logits = np.log(p_rows)
    counts = np.zeros(p_rows.shape[1])
    for _ in range(n):
        if q is not None:  # the drafter samples its token from q
            draft = [int(rng.choice(q.shape[1], p=q[0]))]
        acc, nxt = accept_sampled(probabilities(logits, 1.0), draft, rng, q)
        counts[draft[0] if acc else nxt] += 1
    return counts


def _chi2_ok(counts, p) -> bool:
    """Pearson's chi-square against p, at the 0.1% level (cells with expected counts >= 5)."""
    from scipy.stats import chi2

    n = counts.sum()
    exp = n * p
    keep = exp >= 5
    stat = (((counts - exp) ** 2)[keep] / exp[keep]).sum() + 0.0
    return stat < chi2.ppf(0.999, keep.sum() - 1)


@pytest.mark.parametrize("case", range(3))
def test_speculative_sampling_preserves_the_distribution(case):
    rng = np.random.default_rng(100 + case)
    V = 12
    p = rng.dirichlet(np.full(V, 0.7), size=2)
    q = rng.dirichlet(np.full(V, 0.7), size=1)
    n = 4000
    # a drafter with a distribution (min(1, p/q), residual max(0, p - q))
    assert _chi2_ok(_first_token_distribution(p, None, q, n, case), p[0])
    # prompt lookup: a point mass on a likely token and on an unlikely one
    for x in (int(np.argmax(p[0])), int(np.argmin(p[0]))):
        assert _chi2_ok(_first_token_distribution(p, [x], None, n, case + 10), p[0])


def test_sampling_detects_a_wrong_residual():
    """The test above can fail: sampling the rejection's replacement from p itself (not the residual)
    over-weights the drafted token, and the chi-square test sees it."""
    rng = np.random.default_rng(7)
    p = np.array([[0.6, 0.2, 0.1, 0.1], [0.25, 0.25, 0.25, 0.25]])
    counts = np.zeros(4)
    for _ in range(4000):
        if rng.random() < p[0, 0]:
            counts[0] += 1
        else:
            counts[int(rng.choice(4, p=p[0]))] += 1  # wrong: should exclude token 0
    assert not _chi2_ok(counts, p[0])


def test_probabilities_are_a_stable_softmax():
    z = np.array([[1000.0, 999.0, -5.0]])
    p = probabilities(z, 0.5)
    assert np.isfinite(p).all() and abs(p.sum() - 1) < 1e-12
    assert p[0, 0] / p[0, 1] == pytest.approx(np.exp(2.0))


def _curve(slope=0.15, k=16):
    return [1.0] + [1.0 + slope * j for j in range(1, k + 1)]


def test_controller_chains_long_drafts_when_they_are_accepted():
    c = ChainController(_curve(), 16)
    for _ in range(30):
        c.accepted("a", 8, 8)
    assert c.rate("a") > 0.97  # the prior decays with the evidence: no cap below 1
    assert c.length("a", 16) >= 8


def test_controller_backs_off_when_drafts_fail_and_recovers_from_shadow_checks():
    c = ChainController(_curve(0.25), 16)  # a verification step of 2 tokens costs 1.25 decode steps
    assert c.length("b", 8) == 0  # the prior (one in four) is not worth a verification step
    for _ in range(10):
        c.shadow("b", True)  # unverified drafts that decoding confirmed
    assert c.length("b", 8) >= 2
    for _ in range(20):
        c.accepted("b", 4, 0)
    assert c.length("b", 8) == 0
    for _ in range(40):
        c.shadow("b", True)  # the drafts turned out right after all
    assert c.length("b", 8) >= 1


def test_controller_follows_the_measured_verification_cost():
    cheap, costly = ChainController(_curve(), 16), ChainController(_curve(), 16)
    for c, ratio in ((cheap, 1.3), (costly, 4.0)):
        for _ in range(30):
            c.accepted("x", 8, 5)
            c.timed(0, 0.01)
            c.timed(8, 0.01 * ratio)
    assert costly.cost(8) > 3.0 > cheap.cost(8)
    assert costly.length("x", 16) < cheap.length("x", 16)


def test_controller_charges_a_draft_model_for_each_drafted_token():
    free, drafted = ChainController(_curve(), 16), ChainController(_curve(), 16)
    for c in (free, drafted):
        for _ in range(30):
            c.accepted("m", 8, 4)  # alpha ~ 0.8
            c.timed(0, 0.01)
    drafted.timed_draft(8, 0.01 * 8 * 0.3)  # each drafted token costs 0.3 decode steps
    assert drafted.draft_cost == pytest.approx(0.3)
    assert 1 <= drafted.length("m", 16, drafted=True) < free.length("m", 16)
    assert drafted.length("m", 16) == free.length("m", 16)  # a lookup draft is free
    drafted.timed_draft(8, 0.01 * 8 * 3.0)
    for _ in range(20):
        drafted.timed_draft(8, 0.01 * 8 * 3.0)  # a draft model slower than the model: never worth it
    assert drafted.length("m", 16, drafted=True) == 0 and not drafted.could_pay()


def test_fixed_chain_verifies_the_whole_draft():
    c = ChainController(_curve(), 8, adaptive=False)
    for _ in range(20):
        c.accepted("x", 8, 0)
    assert c.length("x", 5) == 5 and c.length("x", 30) == 8


def test_config_validation():
    assert not SpeculativeConfig(chain=0).on
    for bad in (dict(chain=-1), dict(chain=40), dict(draft="psychic"), dict(ngram_min=3, ngram_max=2),
                dict(draft="model"), dict(draft="cascade"), dict(draft="ngram", draft_model="d")):
        with pytest.raises(EllmError):
            SpeculativeConfig(**bad)
