"""Schedule spaces: a rule's knobs for one kernel request, with the constraints between them, as a set of
points that a search can enumerate, sample, mutate, cross and encode.

A point assigns every knob of the rule. The searched knobs vary; the others (no effect on this request,
or changing the kernel's results) keep their defaults. Points that build the same kernel (a knob moot
given the others) are one point: `Rule.canonical` maps each to its representative.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import cached_property
from typing import Callable, Iterator, Mapping

Point = dict[str, int]


@dataclass(frozen=True)
class Knob:
    """A schedule parameter. Every knob changes the generated code (tests/test_schedule_knobs.py)."""

    name: str
    default: int
    choices: tuple[int, ...]
    doc: str
    numerics: bool = False  # changes the kernel's results, not only its speed: never chosen on speed alone


@dataclass(frozen=True)
class Constraint:
    """A condition on a point, with the reason it exists (shown when a point is refused)."""

    doc: str  # e.g. "tiles_per_task divides the 36 row tiles"
    holds: Callable[[Mapping[str, int]], bool]


def divides(knob: str, total: int, what: str) -> Constraint:
    return Constraint(f"{knob} divides the {total} {what}", lambda p: total % p[knob] == 0)


@dataclass(frozen=True)
class Space:
    rule: str
    knobs: tuple[Knob, ...]  # the searched knobs, in a fixed order (the encoding's)
    base: Mapping[str, int]  # every knob of the rule at its default for the request
    constraints: tuple[Constraint, ...] = ()
    canon: Callable[[Mapping[str, int]], Point] = field(default=dict, compare=False)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k.name for k in self.knobs)

    def point(self, values: Mapping[str, int] | None = None) -> Point:
        """The canonical point with `values` for some knobs and defaults for the rest."""
        return self.canon({**self.base, **(values or {})})

    @property
    def default(self) -> Point:
        return self.point()

    def violations(self, point: Mapping[str, int]) -> list[str]:
        bad = [f"{k.name}={point[k.name]} is not one of {k.choices}" for k in self.knobs if point[k.name] not in k.choices]
        return bad or [c.doc for c in self.constraints if not c.holds(point)]

    def valid(self, point: Mapping[str, int]) -> bool:
        return not self.violations(point)

    @staticmethod
    def key(point: Mapping[str, int]) -> tuple[tuple[str, int], ...]:
        return tuple(sorted(point.items()))

    @cached_property
    def _all(self) -> tuple[Point, ...]:
        """Every distinct valid point, in odometer order over the knobs' choices (the last knob fastest)."""
        out, seen = [], set()
        for values in _product([k.choices for k in self.knobs]):
            p = self.point(dict(zip(self.names, values)))
            k = self.key(p)
            if k not in seen and self.valid(p):
                seen.add(k)
                out.append(p)
        return tuple(out)

    def points(self) -> Iterator[Point]:
        return (dict(p) for p in self._all)

    def __len__(self) -> int:
        return len(self._all)

    def sample(self, rng: random.Random) -> Point:
        """A uniformly drawn valid point."""
        return dict(rng.choice(self._all))

    def mutate(self, point: Mapping[str, int], rng: random.Random, tries: int = 32) -> Point:
        """`point` with one knob moved to another of its choices (a valid, different point where one exists)."""
        for _ in range(tries):
            k = rng.choice(self.knobs)
            others = [c for c in k.choices if c != point[k.name]]
            if not others:
                continue
            p = self.point({**point, k.name: rng.choice(others)})
            if self.valid(p) and self.key(p) != self.key(point):
                return p
        return self.sample(rng)

    def neighbours(self, point: Mapping[str, int]) -> list[Point]:
        """Every distinct valid point that differs from `point` in one knob."""
        out, seen = [], {self.key(point)}
        for k in self.knobs:
            for c in k.choices:
                p = self.point({**point, k.name: c})
                key = self.key(p)
                if key not in seen and self.valid(p):
                    seen.add(key)
                    out.append(p)
        return out

    def crossover(self, a: Mapping[str, int], b: Mapping[str, int], rng: random.Random, tries: int = 16) -> Point:
        """Each searched knob from a or b at random (a valid point; else a)."""
        for _ in range(tries):
            p = self.point({n: (a if rng.random() < 0.5 else b)[n] for n in self.names})
            if self.valid(p):
                return p
        return dict(a)

    def encode(self, point: Mapping[str, int]) -> list[float]:
        """Features of a point for a cost model: each searched knob's value and its index among the choices."""
        out: list[float] = []
        for k in self.knobs:
            v = point[k.name]
            out += [float(v), float(k.choices.index(v)) if v in k.choices else -1.0]
        return out


def _product(choices: list[tuple[int, ...]]) -> Iterator[tuple[int, ...]]:
    if not choices:
        yield ()
        return
    for head in _product(choices[:-1]):
        for c in choices[-1]:
            yield (*head, c)


__all__ = ["Constraint", "Knob", "Point", "Space", "divides"]
