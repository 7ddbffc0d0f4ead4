"""Schedule rules: each says whether it applies to a kernel request and builds a tunable TIR kernel."""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping

from ..compiler.graph import OpKind, TensorType
from ..quant import QuantType
from ..targets import TargetPreset
from .space import Constraint, Knob, Space


@dataclass(frozen=True)
class KernelRequest:
    """One op as lowering asks for it: types of the tensors it reads and writes, with the step's token count bound.

    `m` is the token count: an int for a static shape, None for a symbolic one (prefill chunks).
    `in_cols` gives, per input, the column slice read from that tensor (None: all of it).
    """

    kind: OpKind
    m: int | None
    in_types: tuple[TensorType, ...]
    in_cols: tuple[tuple[int, int] | None, ...]
    out_types: tuple[TensorType, ...]
    qtype: QuantType | None = None
    weight_shape: tuple[int, int] | None = None  # (rows N, cols K)
    vectors: tuple[str, ...] = ()  # roles of vector parameters present: "norm", "bias"
    attrs: tuple[tuple[str, Any], ...] = ()
    more_weights: tuple[tuple[QuantType, int, int, str], ...] = ()  # (qtype, rows, cols, layout) after the first

    def attr(self, name: str, default: Any = None) -> Any:
        return dict(self.attrs).get(name, default)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind.value,
            "m": self.m,
            "in": [[list(map(str, t.shape)), t.dtype] for t in self.in_types],
            "in_cols": [list(c) if c else None for c in self.in_cols],
            "out": [[list(map(str, t.shape)), t.dtype] for t in self.out_types],
            "qtype": self.qtype.name if self.qtype is not None else None,
            "weight": list(self.weight_shape) if self.weight_shape else None,
            "vectors": list(self.vectors),
            "attrs": {k: v for k, v in self.attrs},
            "more_weights": [[q.name, r, c, lay] for q, r, c, lay in self.more_weights],
        }

    def key(self) -> str:
        """A stable, readable kernel name: what it computes plus a digest of the exact request."""
        parts = [self.kind.value]
        if self.qtype is not None:
            parts.append(self.qtype.name.lower())
        if self.weight_shape:
            parts.append(f"{self.weight_shape[0]}x{self.weight_shape[1]}")
        parts.append(f"m{self.m}" if self.m is not None else "mT")
        digest = hashlib.sha1(json.dumps(self.describe(), sort_keys=True).encode()).hexdigest()[:8]
        return "_".join(parts + [digest])


class Rule(ABC):
    """A family of kernels. `build` with `default_knobs` is the default schedule."""

    name: str  # a class attribute, or set per instance by rules built for one of several ISA classes
    knobs: ClassVar[tuple[Knob, ...]] = ()
    # whether `build` runs a request's `numa_tasks` (a NUMA plan's task -> thread map, schedules/node_tasks.py)
    # rather than TVM's static split of its parallel loops
    follows_numa_tasks: ClassVar[bool] = False

    @abstractmethod
    def applies(self, req: KernelRequest, target: TargetPreset) -> bool: ...

    @abstractmethod
    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        """The scheduled kernel: a `tvm.tirx.PrimFunc` whose parameters are (inputs..., params..., outputs...)."""

    def default_knobs(self, req: KernelRequest, target: TargetPreset) -> dict[str, int]:
        return {k.name: k.default for k in self.knobs}

    def active_knobs(self, req: KernelRequest, target: TargetPreset) -> tuple[Knob, ...]:
        """The knobs that change this request's kernel (some only matter for chunks of tokens, say)."""
        return self.knobs

    def constraints(self, req: KernelRequest, target: TargetPreset) -> tuple[Constraint, ...]:
        """What a point must satisfy for this request (divisibility by its shapes, register budgets)."""
        return ()

    def space(self, req: KernelRequest, target: TargetPreset, numerics: bool = False) -> Space:
        """The request's schedule space: its active knobs (without `numerics`, only those that keep the
        kernel's results: the speed-search space) under the rule's constraints."""
        knobs = tuple(k for k in self.active_knobs(req, target) if numerics or not k.numerics)
        return Space(self.name, knobs, self.default_knobs(req, target), self.constraints(req, target),
                     lambda p: self.canonical(req, target, p))

    def canonical(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]) -> dict[str, int]:
        """`knobs` with every knob that has no effect given the others set to its default, so that points of
        the space that build the same kernel compare equal."""
        return dict(knobs)

    def build_kernel(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int], prefetch: bool = True):
        """The kernel exactly as compile ships it: `build`, then the prefetch-injection pass."""
        from .inject_prefetch import inject_prefetch

        return inject_prefetch(self.build(req, target, knobs), enabled=prefetch)

    def resolve_knobs(self, req: KernelRequest, target: TargetPreset, given: Mapping[str, int] | None) -> dict[str, int]:
        knobs = self.default_knobs(req, target)
        for k, v in (given or {}).items():
            if k not in knobs:
                raise ValueError(f"rule {self.name} has no knob {k!r} (knobs: {sorted(knobs)})")
            knobs[k] = int(v)
        bad = [c.doc for c in self.constraints(req, target) if not c.holds(knobs)]
        if bad:
            raise ValueError(f"rule {self.name}: knobs {knobs} break: {'; '.join(bad)}")
        return knobs
