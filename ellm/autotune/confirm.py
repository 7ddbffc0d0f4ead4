"""Re-time a search's fastest points against the default, in alternation, before anything is applied.

A search times each point once, minutes apart, on a machine whose memory bandwidth drifts (a shared VM: 25
to 45 GB/s). Its best point is then partly the best moment: SmolLM2's q4-key attention default timed 198 us
as trial 0 and points like it 103-110 us ten minutes later, a "1.93x" gain. Here the default and the
`top` fastest distinct points are timed `rounds` times, one after the other in each round, and every point
gets the median of its own timings and the number of rounds it beat the default in; the records compile
applies are these (`TuningRecord.confirmed`), each with the default's median from the same rounds, and a
point counts as faster only if it won every round (by chance, with 5 rounds, 1 in 32).
"""

from __future__ import annotations

import statistics

from ..schedules import KernelRequest, Rule
from ..schedules.space import Point, Space
from ..targets import TargetPreset
from .builder import BuildJob
from .runner import Trial

CONFIRM_TOP = 3
CONFIRM_ROUNDS = 5


def contenders(trials, default: Point, top: int) -> list[Point]:
    """The default, then the `top` fastest distinct points that ran (the default itself excluded)."""
    seen = {Space.key(default)}
    out = [default]
    for p, t in sorted(((p, t) for p, t, *_ in trials if t.status == "ok"), key=lambda pt: pt[1].seconds):
        if len(out) > top:
            break
        if Space.key(p) not in seen:
            seen.add(Space.key(p))
            out.append(p)
    return out


def confirm(rule: Rule, req: KernelRequest, target: TargetPreset, points: list[Point], builder, runner,
            prefetch: bool = True, rounds: int = CONFIRM_ROUNDS) -> list[tuple[Point, Trial]]:
    """`points` (the default first) each timed `rounds` times in alternation: (point, Trial) with the median
    of its timings, every timing and its wins over the default (rounds it ran faster) in its stats. A point
    that fails in any round is dropped; if the default fails, nothing is confirmed."""
    built = builder.build([BuildJob(rule.name, req, target.name, p, prefetch) for p in points])
    times: list[list[float]] = [[] for _ in points]
    last: dict[int, Trial] = {}
    alive = list(range(len(points)))
    for _ in range(rounds):
        for i in list(alive):
            t = runner.run(built[i], i == 0)
            if t.status != "ok":
                if i == 0:
                    return []  # the default failed: nothing to compare with
                alive.remove(i)
                continue
            times[i].append(t.seconds)
            last[i] = t
    out = []
    for i in alive:
        ts, t = times[i], last[i]
        wins = sum(a < d for a, d in zip(ts, times[0]))
        stats = dict(t.stats, median=statistics.median(ts), min=min(ts), max=max(ts), rounds=rounds, timings=ts, wins=wins)
        out.append((points[i], Trial("ok", statistics.median(ts), stats, runner=t.runner)))
    return out


__all__ = ["CONFIRM_ROUNDS", "CONFIRM_TOP", "confirm", "contenders"]
