"""Confirmation: a search's fastest points are re-timed with the default in alternation, and compile applies
only a point that beat the default in every round (a search's best time is partly its quietest moment)."""

from __future__ import annotations

import dataclasses

from test_search import _FakeBuilder, _smollm2
from test_tuning_db import REQ, _rec

from ellm.autotune import TuningDatabase
from ellm.autotune.cli import CONFIRM_ROUNDS as CLI_ROUNDS
from ellm.autotune.cli import CONFIRM_TOP as CLI_TOP
from ellm.autotune.confirm import CONFIRM_ROUNDS, CONFIRM_TOP, confirm, contenders
from ellm.autotune.runner import Trial
from ellm.schedules import select_rule
from ellm.targets import get_preset

ZEN4 = get_preset("znver4")


class _Drifting:
    """Times from a script: point -> one time per round, in the order the rounds run."""

    name = "fake"

    def __init__(self, script):
        self.script = script
        self.calls: list[tuple[int, bool]] = []
        self.count: dict[int, int] = {}

    def run(self, built, is_default=False):
        p = built.job.knobs["tiles_per_task"]
        i = self.count.get(p, 0)
        self.count[p] = i + 1
        self.calls.append((p, is_default))
        t = self.script[p][i]
        return Trial("ok", t, {"median": t}) if t else Trial("run_error", message="crashed")


def _points(rule, req, n):
    """The default and n valid points with other tiles per task, each its own."""
    space = rule.space(req, ZEN4)
    out, seen = [space.default], {space.default["tiles_per_task"]}
    for p in space.points():
        if len(out) > n:
            break
        if p["tiles_per_task"] not in seen:
            seen.add(p["tiles_per_task"])
            out.append(p)
    return out


def test_the_defaults_in_the_cli_are_the_module_s():
    assert (CLI_TOP, CLI_ROUNDS) == (CONFIRM_TOP, CONFIRM_ROUNDS)


def test_contenders_are_the_default_then_the_fastest_distinct_points():
    req = _smollm2("gemv")
    rule = select_rule(req, ZEN4)
    d, a, b, c = _points(rule, req, 3)
    trials = [(d, Trial("ok", 5.0), 0.0), (a, Trial("ok", 3.0), 1.0), (b, Trial("wrong"), 2.0),
              (a, Trial("ok", 2.0), 3.0), (c, Trial("ok", 4.0), 4.0)]
    assert contenders(trials, d, 3) == [d, a, c]
    assert contenders(trials, d, 1) == [d, a]


def test_only_a_point_faster_in_every_round_beats_the_default():
    """Point a is 5% faster in every round; point b has the best median but lost one round to the default;
    c crashes once and is dropped. The database then applies a, whose median gain is smaller than b's."""
    req = _smollm2("gemv")
    rule = select_rule(req, ZEN4)
    d, a, b, c = _points(rule, req, 3)
    T = lambda p: p["tiles_per_task"]  # noqa: E731
    drift = [1.0, 1.3, 0.9, 1.1, 1.0]  # the machine's speed over the rounds
    runner = _Drifting({T(d): [10 * x for x in drift], T(a): [9.5 * x for x in drift],
                        T(b): [8.0, 9.0, 8.5, 12.0, 8.5], T(c): [5.0, None, 5.0, 5.0, 5.0]})
    done = confirm(rule, req, ZEN4, [d, a, b, c], _FakeBuilder(), runner, rounds=5)
    assert [p for p, _ in done] == [d, a, b]
    # the default runs first in every round, and sets the reference each time
    assert [p for p, _ in runner.calls[:4]] == [T(d), T(a), T(b), T(c)] and runner.calls[0] == (T(d), True)
    assert all(is_default == (p == T(d)) for p, is_default in runner.calls)
    (_, td), (_, ta), (_, tb) = done
    assert td.seconds == 10.0 and ta.seconds == 9.5 and tb.seconds == 8.5
    assert ta.stats["wins"] == 5 and tb.stats["wins"] == 4 and ta.stats["rounds"] == 5
    assert ta.stats["timings"] == [9.5 * x for x in drift]

    db = TuningDatabase()
    db.add(_rec("cpu A", 2, 16, 1e-6, default_seconds=4e-6))  # the search's own: a 4x "gain" at a quiet moment
    for rows, t in ((8, ta), (32, tb)):  # as records of the float GEMV rule (its knob: rows_per_task)
        db.add(dataclasses.replace(_rec("cpu A", 2, rows, t.seconds, default_seconds=td.seconds), stats=t.stats, confirmed=True))
    (best,) = db.records()
    assert best.confirmed and best.knobs == {"rows_per_task": 8} and best.beats_default()
    assert db.lookup_for("znver4", "cpu A", 2)(REQ, "gemv") == {"rows_per_task": 8}


def test_a_confirmation_no_point_wins_keeps_the_defaults():
    db = TuningDatabase()
    db.add(_rec("cpu A", 2, 16, 1e-6, default_seconds=4e-6))  # the search's inflated gain
    lost = _rec("cpu A", 2, 16, 3.9e-6, default_seconds=4e-6)
    db.add(dataclasses.replace(lost, stats={"wins": 3, "rounds": 5}, confirmed=True))  # a better median, not every round
    look = db.lookup_for("znver4", "cpu A", 2)
    assert look(REQ, "gemv") is None and look.slower == {REQ.key()}


def test_a_default_that_fails_when_re_timed_confirms_nothing():
    req = _smollm2("gemv")
    rule = select_rule(req, ZEN4)
    d, a = _points(rule, req, 1)
    T = lambda p: p["tiles_per_task"]  # noqa: E731
    runner = _Drifting({T(d): [None] * 5, T(a): [1.0] * 5})
    assert confirm(rule, req, ZEN4, [d, a], _FakeBuilder(), runner, rounds=5) == []
