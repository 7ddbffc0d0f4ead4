"""A NUMA plan's task loop, so that a kernel's task -> thread map is the plan's: one parallel task per thread,
the threads of a node consecutive, each task running its share of its own node's unit ranges.

TVM splits a parallel loop statically (task i of T takes iterations [i ceil(n/T), (i+1) ceil(n/T))), so a loop
of exactly T iterations gives iteration i to thread i, which eLLM pins to CPU `cpus[i]` (runtime/threads.py).
Within node k (tasks s_k .. s_k + t_k - 1, ranges [a, b) in units), thread j takes units
[a + (b - a) j // t_k, a + (b - a) (j + 1) // t_k) of each range: numa/plan.py's `tasks`, computed in the kernel
by a chain of selects over the nodes (once per task).

The plan pass (compiler/passes/plan_numa_layout.py) gives a request this as its `numa_tasks` attribute; a rule
that honours it builds its parallel loop with `NodeTasks.loop`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from tvm import tirx
from tvm.tirx.script.builder import ir as I

ATTR = "numa_tasks"


@dataclass(frozen=True)
class NodeTasks:
    threads: tuple[int, ...]  # [node] -> threads, whose tasks are consecutive
    ranges: tuple[tuple[tuple[int, int], ...], ...]  # [node] -> R unit ranges [start, end) (empty ones pad)

    def __post_init__(self):
        if len(self.threads) != len(self.ranges) or not self.threads or min(self.threads) < 1:
            raise ValueError(f"node tasks need >= 1 thread per node: {self.threads} for {len(self.ranges)} nodes")
        if len({len(r) for r in self.ranges}) != 1:
            raise ValueError("every node needs the same number of ranges (pad with empty ones)")

    @classmethod
    def make(cls, threads, ranges) -> NodeTasks:
        """From a plan's per-node ranges (any count per node): padded to the same count with empty ranges."""
        width = max(1, max(len(r) for r in ranges))
        padded = tuple(tuple(tuple(int(x) for x in r) for r in rs) + ((0, 0),) * (width - len(rs)) for rs in ranges)
        return cls(tuple(int(t) for t in threads), padded)

    @classmethod
    def of(cls, req) -> NodeTasks | None:
        """The request's node tasks (its `numa_tasks` attribute), or None: TVM's static partition."""
        a = req.attr(ATTR)
        return None if a is None else cls(tuple(a[0]), tuple(tuple(tuple(r) for r in rs) for rs in a[1]))

    def to_attr(self) -> tuple[Any, ...]:
        return (self.threads, self.ranges)

    @property
    def n_tasks(self) -> int:
        return sum(self.threads)

    @property
    def width(self) -> int:
        return len(self.ranges[0])

    def scaled(self, per: int) -> NodeTasks:
        """The same ranges in units of `per` of these (each range must be whole units)."""
        if any(a % per or b % per for rs in self.ranges for a, b in rs):
            raise ValueError(f"node ranges {self.ranges} are not whole units of {per}")
        return NodeTasks(self.threads, tuple(tuple((a // per, b // per) for a, b in rs) for rs in self.ranges))

    def task_ranges(self, task: int) -> list[tuple[int, int]]:
        """The unit ranges task `task` runs (numa/plan.py's `tasks`, in these units)."""
        first = 0
        for t, rs in zip(self.threads, self.ranges):
            if task < first + t:
                j = task - first
                return [(a + (b - a) * j // t, a + (b - a) * (j + 1) // t) for a, b in rs]
            first += t
        raise IndexError(task)

    def bounds(self, task, scale=None, dtype: str = "int64") -> list[tuple[Any, Any]]:
        """The unit ranges of `task` (a PrimExpr) as PrimExprs: a select over nodes for each bound. `scale`: each
        unit stands for that many finer ones (a PrimExpr known at run time), shared out among a node's threads."""
        dt = dtype
        s = None if scale is None else tirx.const(scale, dt) if isinstance(scale, int) else tirx.Cast(dt, scale)

        def c(v):
            v = tirx.const(v, dt)
            return v if s is None else v * s

        out = []
        for r in range(self.width):
            lo = hi = None
            first = sum(self.threads)
            for t, rs in reversed(list(zip(self.threads, self.ranges))):
                first -= t
                a, b = rs[r]
                j = task - tirx.const(first, dt)
                t_ = tirx.const(t, dt)
                f_lo = c(a) + tirx.floordiv(c(b - a) * j, t_)
                f_hi = c(a) + tirx.floordiv(c(b - a) * (j + tirx.const(1, dt)), t_)
                if lo is None:
                    lo, hi = f_lo, f_hi
                else:
                    inside = task < tirx.const(first + t, dt)
                    lo, hi = tirx.Select(inside, f_lo, lo), tirx.Select(inside, f_hi, hi)
            out.append((lo, hi))
        return out

    def loop(self, body: Callable[[Any, list[tuple[Any, Any]]], None], dtype: str = "int64", scale=None) -> None:
        """body(task, [(lo, hi)] per range) in a parallel loop of one task per thread."""
        with I.parallel(tirx.const(0, dtype), tirx.const(self.n_tasks, dtype)) as task:
            body(task, [(I.Bind(lo), I.Bind(hi)) for lo, hi in self.bounds(task, scale, dtype)])
