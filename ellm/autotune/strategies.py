"""Search strategies over a schedule space: each proposes the next points to measure and learns from results.

A strategy is one small class: `propose(n)` returns up to n points not measured yet, `observe(results)`
receives (point, seconds or None for a failure) pairs. The tuner measures the space's default first and
feeds it to the strategy like any other trial.
"""

from __future__ import annotations

import math
import random
from typing import Callable, Sequence

import numpy as np

from ..schedules.space import Point, Space

Result = tuple[Point, "float | None"]


class Strategy:
    """Base: remembers what was measured, so no point is proposed twice."""

    name = "base"

    def __init__(self, space: Space, seed: int = 0):
        self.space = space
        self.rng = random.Random(seed)
        self.seen: set = set()
        self.results: list[Result] = []

    def fresh(self, p: Point) -> bool:
        return self.space.key(p) not in self.seen

    def take(self, p: Point) -> Point:
        self.seen.add(self.space.key(p))
        return p

    def observe(self, results: Sequence[Result]) -> None:
        for p, s in results:
            self.seen.add(self.space.key(p))
            self.results.append((p, s))

    def fill(self, out: list[Point], n: int) -> list[Point]:
        """`out` topped up to n with unmeasured points in enumeration order (when a strategy's own moves
        only find measured points: small spaces, or their last few points)."""
        if len(out) < n:
            for p in self.space.points():
                if len(out) == n:
                    break
                if self.fresh(p):
                    out.append(self.take(p))
        return out

    def best(self, k: int = 1) -> list[Point]:
        ok = sorted((s, i) for i, (_, s) in enumerate(self.results) if s is not None)
        return [self.results[i][0] for _, i in ok[:k]]

    def propose(self, n: int) -> list[Point]:
        raise NotImplementedError

    def exhausted(self) -> bool:
        return all(not self.fresh(p) for p in self.space.points())


class GridSearch(Strategy):
    """Every point in the space's enumeration order (the last knob fastest)."""

    name = "grid"

    def __init__(self, space: Space, seed: int = 0):
        super().__init__(space, seed)
        self._it = space.points()

    def propose(self, n: int) -> list[Point]:
        out = []
        for p in self._it:
            if self.fresh(p):
                out.append(self.take(p))
                if len(out) == n:
                    break
        return out


class RandomSearch(Strategy):
    """Distinct points drawn uniformly."""

    name = "random"

    def __init__(self, space: Space, seed: int = 0):
        super().__init__(space, seed)
        self._order = list(space.points())
        self.rng.shuffle(self._order)

    def propose(self, n: int) -> list[Point]:
        out = []
        while self._order and len(out) < n:
            p = self._order.pop()
            if self.fresh(p):
                out.append(self.take(p))
        return out


class EvolutionarySearch(Strategy):
    """A population of the fastest points so far; children by crossover of two tournament winners, then a
    mutation of one knob; random immigrants while the population is small or children repeat."""

    name = "evolutionary"

    def __init__(self, space: Space, seed: int = 0, population: int = 8, mutation: float = 0.7):
        super().__init__(space, seed)
        self.population, self.mutation = population, mutation

    def _parent(self, pop: list[Point]) -> Point:
        a, b = self.rng.randrange(len(pop)), self.rng.randrange(len(pop))
        return pop[min(a, b)]  # pop is sorted fastest first: the better of two

    def propose(self, n: int) -> list[Point]:
        pop = self.best(self.population)
        out: list[Point] = []
        for _ in range(50 * n):
            if len(out) == n:
                break
            if len(pop) < 2:
                p = self.space.sample(self.rng)
            else:
                p = self.space.crossover(self._parent(pop), self._parent(pop), self.rng)
                if self.rng.random() < self.mutation or not self.fresh(p):
                    p = self.space.mutate(p, self.rng)
            if self.fresh(p):
                out.append(self.take(p))
        return self.fill(out, n)


class ModelSearch(Strategy):
    """Search guided by a cost model: each batch ranks a pool (every one-knob neighbour of the fastest points
    so far, and random points) by predicted time and takes the best predictions, with a share of random
    points to keep exploring. The model is refit on every observation, starting from `prior` records
    (another kernel's or CPU's)."""

    name = "model"

    def __init__(self, space: Space, seed: int = 0, model=None, features: Callable[[Point], list[float]] | None = None,
                 pool: int = 256, explore: float = 0.2, elite: int = 3, cache: dict | None = None):
        from .cost_model import CostModel

        super().__init__(space, seed)
        self.model = model or CostModel(seed=seed)
        self.features = features or space.encode
        self.pool, self.explore, self.elite = pool, explore, elite
        self._cache: dict = {} if cache is None else cache  # point key -> features (shared by replays of one kernel)

    def _feat(self, p: Point) -> list[float]:
        k = self.space.key(p)
        if k not in self._cache:
            self._cache[k] = self.features(p)
        return self._cache[k]

    def observe(self, results: Sequence[Result]) -> None:
        super().observe(results)
        ok = [(p, s) for p, s in self.results if s is not None]
        if ok:
            self.model.fit([self._feat(p) for p, _ in ok], [math.log(s) for _, s in ok])

    def _pool(self, top: list[Point], n: int) -> list[Point]:
        cands: dict = {}
        for t in top:  # local moves around the best: the landscape is rough, its optima are narrow
            for p in self.space.neighbours(t):
                if self.fresh(p):
                    cands.setdefault(self.space.key(p), p)
        want = max(self.pool, len(cands)) if top else n
        for _ in range(4 * want):
            if len(cands) >= want:
                break
            p = self.space.sample(self.rng)
            if self.fresh(p):
                cands.setdefault(self.space.key(p), p)
        return list(cands.values())

    def propose(self, n: int) -> list[Point]:
        top = self.best(self.elite) if self.model.trained else []
        pts = self._pool(top, n)
        if not top or not pts:  # nothing learnt yet (random points), or nothing new found by sampling
            return self.fill([self.take(p) for p in pts[:n]], n)
        pred = self.model.predict([self._feat(p) for p in pts])
        ranked = [pts[i] for i in np.argsort(pred, kind="stable")]
        greedy = n - int(round(n * self.explore))  # the best predictions, then random picks of the rest
        rest = ranked[greedy:]
        self.rng.shuffle(rest)
        return self.fill([self.take(p) for p in (ranked[:greedy] + rest)[:n]], n)


STRATEGIES: dict[str, type[Strategy]] = {s.name: s for s in (GridSearch, RandomSearch, EvolutionarySearch, ModelSearch)}

__all__ = ["STRATEGIES", "EvolutionarySearch", "GridSearch", "ModelSearch", "RandomSearch", "Strategy"]
