"""The sampler (runtime/sampling.py) and stop strings (runtime/textstream.py) against plain NumPy references."""

from __future__ import annotations

import numpy as np
import pytest

from ellm.errors import EllmError
from ellm.runtime.sampling import Sampler, SamplingConfig, draw
from ellm.runtime.textstream import StopMatcher, TextStream, check_stops


def _softmax(z):
    z = np.asarray(z, dtype=np.float64)
    e = np.exp(z - z.max())
    return e / e.sum()


def _reference(logits, history, c: SamplingConfig) -> np.ndarray:
    """The same pipeline written the slow, obvious way: a full sort at every stage."""
    z = np.array(logits, dtype=np.float64)
    window = list(history) if c.penalty_last_n < 0 else list(history)[-c.penalty_last_n:] if c.penalty_last_n else []
    for t in set(window):
        n = window.count(t)
        if c.repeat_penalty != 1:
            z[t] = z[t] * c.repeat_penalty if z[t] <= 0 else z[t] / c.repeat_penalty
        z[t] -= n * c.frequency_penalty + c.presence_penalty
    alive = np.ones(z.size, bool)
    if c.top_k:
        order = sorted(range(z.size), key=lambda i: (-z[i], i))
        alive[:] = False
        alive[order[: c.top_k]] = True
    p1 = np.where(alive, np.exp(z - z[alive].max()), 0.0)
    p1 /= p1.sum()
    if c.top_p < 1:
        order = sorted(np.flatnonzero(alive), key=lambda i: (-p1[i], i))
        mass, keep = 0.0, []
        for i in order:
            keep.append(i)
            mass += p1[i]
            if mass >= c.top_p:
                break
        alive[:] = False
        alive[keep] = True
        p1 = np.where(alive, p1, 0.0)
        p1 /= p1.sum()
    if c.min_p > 0:
        alive &= p1 >= c.min_p * p1.max()
    out = np.where(alive, np.exp((z - z[alive].max()) / c.temperature), 0.0)
    return out / out.sum()


@pytest.fixture
def logits():
    return np.random.default_rng(0).normal(0, 3, 300).astype(np.float32)


@pytest.mark.parametrize("cfg", [
    SamplingConfig(temperature=1.0),
    SamplingConfig(temperature=0.7, top_k=20),
    SamplingConfig(temperature=1.3, top_p=0.9),
    SamplingConfig(temperature=0.5, min_p=0.05),
    SamplingConfig(temperature=1.0, top_k=40, top_p=0.95, min_p=0.02),
    SamplingConfig(temperature=0.8, repeat_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.25, top_p=0.8),
])
def test_distribution_matches_the_reference(logits, cfg):
    history = [3, 7, 7, 7, 11, 200, 3, 250]
    p = Sampler(cfg).probabilities(logits, history)
    ref = _reference(logits, history, cfg)
    assert np.array_equal(p > 0, ref > 0)
    np.testing.assert_allclose(p, ref, rtol=1e-9, atol=1e-15)


def test_top_p_keeps_the_smallest_set_reaching_the_mass(logits):
    p1 = _softmax(logits)
    for top_p in (0.1, 0.5, 0.9, 0.99):
        kept = Sampler(SamplingConfig(temperature=1.0, top_p=top_p)).probabilities(logits) > 0
        assert p1[kept].sum() >= top_p - 1e-12
        # one token fewer (the least likely kept) would fall short
        assert p1[kept].sum() - p1[kept].min() < top_p
        assert p1[kept].min() >= p1[~kept].max()


def test_top_p_beyond_the_partial_sort():
    """A flat distribution: 90% of the mass needs 1,800 of 2,000 tokens, more than the candidates looked at
    first, so the full sort runs."""
    z = np.zeros(2000, np.float32)
    z[:10] = 0.01
    p = Sampler(SamplingConfig(temperature=1.0, top_p=0.9)).probabilities(z)
    assert 1795 <= int((p > 0).sum()) <= 1805
    np.testing.assert_allclose(p, _reference(z, [], SamplingConfig(temperature=1.0, top_p=0.9)), rtol=1e-9)


def test_min_p_threshold_is_relative_to_the_most_likely(logits):
    p1 = _softmax(logits)
    p = Sampler(SamplingConfig(temperature=2.0, min_p=0.1)).probabilities(logits)
    np.testing.assert_array_equal(p > 0, p1 >= 0.1 * p1.max())


def test_temperature_applies_after_truncation(logits):
    """Top-p is taken at temperature 1: a high temperature flattens what survives, it does not widen it."""
    a = Sampler(SamplingConfig(temperature=0.3, top_p=0.8)).probabilities(logits)
    b = Sampler(SamplingConfig(temperature=3.0, top_p=0.8)).probabilities(logits)
    np.testing.assert_array_equal(a > 0, b > 0)
    kept = a > 0
    np.testing.assert_allclose(b[kept], _softmax(logits[kept].astype(np.float64) / 3.0), rtol=1e-9)


def test_penalty_arithmetic():
    z = np.array([2.0, -2.0, 1.0, 0.5, 3.0], np.float32)
    cfg = SamplingConfig(temperature=0.0, repeat_penalty=2.0, presence_penalty=0.25, frequency_penalty=0.5)
    out = Sampler(cfg).penalise(z, [0, 1, 1, 1, 2])
    # 0 once: 2/2 - 0.5 - 0.25; 1 three times: -2*2 - 1.5 - 0.25; 2 once: 1/2 - 0.75; 3, 4 unseen
    np.testing.assert_allclose(out, [0.25, -5.75, -0.25, 0.5, 3.0], rtol=1e-6)
    assert z[0] == 2.0  # the input is not changed
    # the window: only the last n tokens count
    windowed = Sampler(SamplingConfig(repeat_penalty=2.0, penalty_last_n=2)).penalise(z, [0, 1, 2])
    np.testing.assert_allclose(windowed, [2.0, -4.0, 0.5, 0.5, 3.0])


def test_greedy_takes_the_argmax_of_the_penalised_logits():
    z = np.array([5.0, 4.0, 1.0], np.float32)
    assert Sampler().choose(z, [0, 0]) == 0
    assert Sampler(SamplingConfig(repeat_penalty=1.5)).choose(z, [0]) == 1
    assert Sampler(SamplingConfig(frequency_penalty=1.0)).choose(z, [0, 0]) == 1


def test_seeded_draws_reproduce_and_follow_the_distribution(logits):
    from scipy.stats import chisquare

    cfg = SamplingConfig(temperature=0.9, top_k=12, seed=42)
    a = [Sampler(cfg).choose(logits) for _ in range(3)]
    s1, s2 = Sampler(cfg), Sampler(cfg)
    assert [s1.choose(logits) for _ in range(50)] == [s2.choose(logits) for _ in range(50)]
    assert len(set(a)) == 1  # the first draw of the same seed
    p = Sampler(cfg).probabilities(logits)
    rng = np.random.default_rng(1)
    counts = np.bincount([draw(p, rng) for _ in range(20000)], minlength=p.size)
    kept = p > 0
    assert counts[~kept].sum() == 0
    assert chisquare(counts[kept], 20000 * p[kept]).pvalue > 1e-3


@pytest.mark.parametrize("bad", [
    dict(temperature=float("nan")), dict(temperature=-0.1), dict(top_p=0.0), dict(top_p=1.5), dict(min_p=-0.1),
    dict(top_k=-1), dict(repeat_penalty=0.0), dict(presence_penalty=3.0), dict(frequency_penalty=float("inf")),
    dict(penalty_last_n=-2), dict(seed=1.5),
])
def test_bad_controls_are_refused(bad):
    with pytest.raises(EllmError):
        SamplingConfig(**bad)


# --- stop strings -----------------------------------------------------------------------------------------

def _feed_all(pieces, stops):
    m = StopMatcher(tuple(stops))
    out = "".join(m.feed(p) for p in pieces)
    return out + m.finish(), m


@pytest.mark.parametrize("pieces,stops,expected", [
    (["Hello", " wor", "ld", "!"], ["world"], "Hello "),
    (["a", "b", "<", "/", "s", ">", "tail"], ["</s>"], "ab"),
    (["x", "<", "/", "q"], ["</s>"], "x</q"),  # a partial match that fails is released
    (["abc"], ["zzz"], "abc"),
    (["ab", "c\nUser:", " hi"], ["\nUser:", "c\n"], "ab"),  # the earliest match wins
    (["to", "ken", "s end with st", "o"], ["stop"], "tokens end with sto"),  # held back, released at the end
])
def test_stop_strings_across_pieces(pieces, stops, expected):
    out, m = _feed_all(pieces, stops)
    assert out == expected
    assert m.stopped == any(s in "".join(pieces) for s in stops)


def test_stop_text_is_never_released_early():
    """Whatever the token boundaries, the text released so far is always a prefix of the final output: no
    piece of the stop string is ever shown."""
    text = "The answer is 42.\n\nQuestion: what next?"
    rng = np.random.default_rng(3)
    for _ in range(200):
        cuts = sorted(set(rng.integers(0, len(text), 6).tolist()))
        pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
        m = StopMatcher(("\n\nQuestion:",))
        shown = ""
        for p in pieces:
            shown += m.feed(p)
            assert "The answer is 42.".startswith(shown)
        assert shown + m.finish() == "The answer is 42."


class _ByteTokenizer:
    """Each token one byte of UTF-8; 0 ends generation."""

    def is_eog(self, t):
        return t == 0

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def test_text_stream_waits_for_whole_characters_and_matches_stops():
    tok = _ByteTokenizer()
    s = TextStream(tok, ("ß!",))
    shown = [s.feed(b) for b in "aé".encode()]
    assert shown == ["a", "", "é"]  # é is two bytes: nothing until the second
    for b in "xß".encode():
        s.feed(b)
    assert not s.stopped
    assert s.feed(ord("!")) == "" and s.stopped and s.matched == "ß!"
    assert s.finish() == ""

    s = TextStream(tok, ())
    out = "".join(s.feed(b) for b in "naïve ☃".encode()) + s.feed(0) + s.finish()
    assert out == "naïve ☃"


def test_check_stops_refuses_bad_lists():
    assert check_stops(["a", "b"]) == ("a", "b")
    for bad in ([""], ["x" * 300], ["a"] * 17, [3]):
        with pytest.raises(EllmError):
            check_stops(bad)
