"""Replay a search on a measured landscape: the builder and runner `search_kernel` takes, answering every
trial with the time a sweep measured for that point, so strategies are compared with many seeds at no cost.

    land = Landscape(space, {Space.key(p): seconds or None, ...})   # None: a point that failed
    res = search_kernel(name, rule, req, preset, opts, land, land, strategy=make_strategy(..., space=land.space))
    curve = best_so_far(res)
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from ..schedules.space import Constraint, Space
from .builder import BuildJob
from .runner import Trial
from .tuner import KernelSearch


def restricted(space: Space, keys: set, doc: str) -> Space:
    """`space` limited to the points whose keys are in `keys`."""
    return dataclasses.replace(space, constraints=space.constraints + (Constraint(doc, lambda p: Space.key(p) in keys),))


class Landscape:
    """Measured seconds per point (None: failed); `space` is the rule's space limited to those points."""

    def __init__(self, space: Space, seconds: Mapping[tuple, float | None]):
        self.seconds = dict(seconds)
        self.space = restricted(space, set(self.seconds), "measured in the sweep")

    def build(self, jobs: Sequence[BuildJob]) -> list[BuildJob]:
        return list(jobs)

    def run(self, job: BuildJob, is_default: bool = False) -> Trial:
        t = self.seconds.get(Space.key(job.knobs))
        return Trial("ok", t, {"median": t}, runner="replay") if t is not None else Trial("run_error", message="failed in the sweep")


def best_so_far(res: KernelSearch) -> list[float | None]:
    """Best seconds after each trial of a search, in measurement order (None until one succeeds)."""
    best, curve = None, []
    for _, trial, _ in res.trials:
        if trial.status == "ok" and (best is None or trial.seconds < best):
            best = trial.seconds
        curve.append(best)
    return curve
