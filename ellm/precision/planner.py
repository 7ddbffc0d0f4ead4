"""The planner: the plan with the least predicted KL (the sum of the measured single-part KLs of its choices)
whose decode step reads at most a budget of bytes at a stated context.

Decisions: per layer the fused groups (Q+K+V, gate+up: one kernel reads one format) and the O and down
weights, the output head (one type, or split into likely rows at the source type and the rest lower), and
each layer's KV reads: its K cache type, V cache type and top-K read budget together (a layer's read bytes
depend on all three: fewer blocks at a higher precision can cost fewer bytes and less KL than more blocks at
a lower one). Each decision picks one choice (a type, its
bytes, its predicted KL): a multiple-choice knapsack, solved exactly by dynamic programming over bytes in
units of budget / `UNITS` with every cost rounded up, so the chosen plan never exceeds its budget.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace

import numpy as np

from ..errors import EllmError
from ..kv.attention import AttentionConfig
from ..kv.plan import KVPlan, KVType
from .analysis import READ_TOPK, SensitivityTable, hot_sizes, reads_type, split_type
from .plan import GROUPS, HeadSplit, PrecisionPlan, WeightInfo

UNITS = 20000
KV_CHOICES = (KVType.F16, KVType.Q8, KVType.Q4)


@dataclass(frozen=True)
class Choice:
    type: str  # QuantType name, KVType value, or a split head's analysis.split_type
    bytes: int  # read per decoded token
    kl: float  # predicted: the sum of its parts' measured KLs
    split: HeadSplit | None = None  # the head's row sets (hot rows at the source type)


@dataclass(frozen=True)
class Decision:
    name: str  # e.g. "blk.3.attn_q+k+v", "token_embd.weight", "blk.3.kv"
    kind: str  # "weights" or "kv"
    layer: int | None
    parts: tuple[str, ...]  # weight names (or the cache part)
    choices: tuple[Choice, ...]  # the first is the source / unmodified


@dataclass(frozen=True)
class KVGeometry:
    """What a layer's KV read bytes depend on."""

    n_kv_heads: int
    head_dim: int
    block: int = 64
    recent: int = 2
    max_chunk: int = 256
    pinned: int = 1
    rotate_k: bool = True

    def side_bytes(self, side: str, t: KVType, ctx: int, attention: AttentionConfig) -> int:
        one = KVPlan.per_layer(self.n_kv_heads, self.head_dim, (t,), (t,), self.max_chunk, self.block, self.recent,
                               self.pinned, self.rotate_k)
        return one.read_bytes(ctx, attention, 0, kinds=(side,))


def _weight_groups(infos: list[WeightInfo]) -> list[list[WeightInfo]]:
    """Weights that must share a type: a layer's fused siblings where they share source type and row length."""
    out: list[list[WeightInfo]] = []
    by_layer: dict[int | None, dict[str, WeightInfo]] = {}
    for i in infos:
        by_layer.setdefault(i.layer, {})[i.part] = i
    for layer, parts in by_layer.items():
        used: set[str] = set()
        for group in GROUPS:
            members = [parts[p] for p in group if p in parts]
            if len(members) == len(group) and len({(m.source, m.cols) for m in members}) == 1:
                out.append(members)
                used |= set(group)
        out += [[i] for p, i in parts.items() if p not in used]
    return out


def decisions(infos: list[WeightInfo], table: SensitivityTable, n_layers: int, kv: KVGeometry, ctx: int,
              attention: AttentionConfig, fixed_k: KVType | None = None, fixed_v: KVType | None = None) -> list[Decision]:
    """Every decision and its choices. `fixed_k`/`fixed_v`: a cache type the user chose (--cache-type-k/v):
    that side's only choice, its bytes still counted."""
    out = []
    for members in _weight_groups(infos):
        types = [t for t in members[0].candidates() if all(t in m.candidates() for m in members)]
        choices = []
        for t in types:
            if t is members[0].source:
                kl = 0.0
            elif all(table.has(m.name, t.name) for m in members):
                kl = sum(table.kl(m.name, t.name) for m in members)
            else:
                continue  # not measured: not offered
            choices.append(Choice(t.name, sum(m.nbytes(t) for m in members), kl))
        m0 = members[0]
        if m0.part == "head":
            choices += _split_choices(m0, table)
        name = m0.name if len(members) == 1 else f"blk.{m0.layer}.{'+'.join(m.part for m in members)}"
        out.append(Decision(name, "weights", m0.layer, tuple(m.name for m in members), tuple(choices)))
    for layer in range(n_layers):
        sides = []
        for side, fixed in (("k", fixed_k), ("v", fixed_v)):
            part = f"blk.{layer}.{side}_cache"
            types = (fixed,) if fixed is not None else [t for t in KV_CHOICES if t.is_float or table.has(part, t.value)]
            sides.append([(t, 0.0 if t.is_float else table.kl(part, t.value)) for t in types])
        reads = f"blk.{layer}.reads"
        budgets = [(attention.topk, 0.0)] + [(k, table.kl(reads, reads_type(k))) for k in READ_TOPK
                                             if k < attention.topk and table.has(reads, reads_type(k))]
        choices = []
        for (kt, kl_k), (vt, kl_v), (topk, kl_r) in itertools.product(*sides, budgets):
            a = replace(attention, topk=topk)
            nbytes = kv.side_bytes("k", kt, ctx, a) + kv.side_bytes("v", vt, ctx, a)
            choices.append(Choice(kv_type(kt, vt, topk), nbytes, kl_k + kl_v + kl_r))
        parts = (f"blk.{layer}.k_cache", f"blk.{layer}.v_cache", reads)
        out.append(Decision(f"blk.{layer}.kv", "kv", layer, parts, tuple(choices)))
    return out


def kv_type(k: KVType, v: KVType, topk: int) -> str:
    """A layer's KV choice: "q8/q4/22" (K type, V type, remote blocks read)."""
    return f"{k.value}/{v.value}/{topk}"


def _split_choices(head: WeightInfo, table: SensitivityTable) -> list[Choice]:
    """The measured split heads that fit: hot rows at the source type, the rest at a lower candidate."""
    out = []
    for t in head.candidates()[1:]:
        for n in hot_sizes(head.rows):
            if n > len(table.vocab_order) or not table.has(head.name, split_type(t.name, n)):
                continue
            split = HeadSplit(tuple(sorted(table.vocab_order[:n])), t)
            if split.fits(head, head.source):
                out.append(Choice(split_type(t.name, n), split.nbytes(head, head.source),
                                  table.kl(head.name, split_type(t.name, n)), split))
    return out


def solve(ds: list[Decision], budget: int) -> list[int]:
    """The choice index per decision minimising the total KL within `budget` bytes (exact over rounded-up
    costs). An error if even the cheapest choices exceed the budget."""
    cheapest = sum(min(c.bytes for c in d.choices) for d in ds)
    if cheapest > budget:
        raise EllmError(f"no plan fits a budget of {budget / 1e6:.2f} MB per token: the smallest reads "
                        f"{cheapest / 1e6:.2f} MB")
    unit = budget / UNITS
    inf = np.inf
    best = np.zeros(UNITS + 1)  # best[b]: least KL of the decisions so far within b units
    picks = np.zeros((len(ds), UNITS + 1), np.int8)
    for j, d in enumerate(ds):
        new = np.full(UNITS + 1, inf)
        for ci, c in enumerate(d.choices):
            cost = int(np.ceil(c.bytes / unit))
            if cost > UNITS:
                continue
            cand = np.full(UNITS + 1, inf)
            cand[cost:] = best[: UNITS + 1 - cost] + c.kl
            better = cand < new
            new[better] = cand[better]
            picks[j, better] = ci
        best = new
    b = int(np.argmin(best))  # the least KL (ties: fewest bytes)
    if not np.isfinite(best[b]):
        raise EllmError(f"no plan fits a budget of {budget / 1e6:.2f} MB per token once costs are rounded up")
    out = [0] * len(ds)
    for j in range(len(ds) - 1, -1, -1):
        ci = int(picks[j, b])
        out[j] = ci
        b -= int(np.ceil(ds[j].choices[ci].bytes / unit))
    return out


def plan_bytes(ds: list[Decision], picks: list[int]) -> int:
    return sum(d.choices[i].bytes for d, i in zip(ds, picks))


def to_plan(ds: list[Decision], picks: list[int], n_layers: int, origin: str, notes: tuple[str, ...] = (),
            default_topk: int = AttentionConfig().topk) -> PrecisionPlan:
    from ..quant import QuantType

    weights, k, v = [], [KVType.F16] * n_layers, [KVType.F16] * n_layers
    reads = [default_topk] * n_layers
    predicted, split = 0.0, None
    for d, i in zip(ds, picks):
        c = d.choices[i]
        predicted += c.kl
        if c.split is not None:
            split = c.split
        elif d.kind == "weights":
            if i != 0:
                weights += [(name, QuantType[c.type]) for name in d.parts]
        else:
            kt, vt, topk = c.type.split("/")
            k[d.layer], v[d.layer], reads[d.layer] = KVType(kt), KVType(vt), int(topk)
    return PrecisionPlan(tuple(weights), tuple(k), tuple(v), None, origin, notes, predicted, head_split=split,
                         reads=tuple(reads))
