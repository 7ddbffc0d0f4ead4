"""A precision plan: the storage type of every weight and of every layer's K and V cache, relative to the source.

Plans only lower. A type above the GGUF's own recovers nothing that quantisation already threw away, so
`candidates` never offers one; a plan that asks for one anyway (a quant level's 8-bit attention on a Q4_1
model) keeps the source type and says so in `notes`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable

from ..errors import EllmError
from ..kv.plan import KVType
from ..quant import FORMATS, QuantType
from ..quant.requantize import TARGET_TYPES
from ..quant.tiled import tiled_supported


def bits(qtype: QuantType) -> float:
    return FORMATS[qtype].bits_per_weight


def candidates(source: QuantType, rows: int, cols: int) -> list[QuantType]:
    """The types a [rows, cols] weight stored as `source` may be lowered to, the source first, then by
    falling bits per weight: no more bits than the source, whole blocks per row, and a 16-row tiled layout
    for the integer kernels (every row count here is a multiple of 16, or the source is kept)."""
    out = [source]
    for t in TARGET_TYPES:
        if t is source or bits(t) > bits(source) or cols % FORMATS[t].block:
            continue
        if not tiled_supported(t, rows, cols) and tiled_supported(source, rows, cols):
            continue  # would push the weight off the integer kernels
        out.append(t)
    return out


@dataclass(frozen=True)
class WeightInfo:
    """A GGUF weight a plan decides: its name, source type and shape, and which part of which layer it is."""

    name: str
    source: QuantType
    rows: int
    cols: int
    layer: int | None  # None: the output head (tied to the embedding or not)
    part: str  # "q", "k", "v", "o", "gate", "up", "down", "head"

    @property
    def elements(self) -> int:
        return self.rows * self.cols

    def nbytes(self, qtype: QuantType) -> int:
        return FORMATS[qtype].row_bytes(self.cols) * self.rows

    def candidates(self) -> list[QuantType]:
        return candidates(self.source, self.rows, self.cols)


PARTS = {"attn_q": "q", "attn_k": "k", "attn_v": "v", "attn_output": "o", "ffn_gate": "gate", "ffn_up": "up",
         "ffn_down": "down"}
# parts that share a fused kernel (one weight in one format): a plan gives them one type per layer
GROUPS = (("q", "k", "v"), ("gate", "up"))


def weight_infos(g) -> list[WeightInfo]:
    """The plan-relevant weights of an imported graph (before fusion: one GGUF tensor per weight)."""
    from ..compiler.graph import OpKind

    out = []
    for name, op in g.nodes():
        if op.kind is OpKind.LM_HEAD:
            w = op.weight
            out.append(WeightInfo(w.sources[0], w.qtype, w.rows, w.cols, None, "head"))
        elif op.kind is OpKind.MATMUL:
            w = op.weight
            part = PARTS.get(name.rsplit(".", 1)[-1])
            if part is None:
                raise EllmError(f"precision plan: unknown matmul {name}")
            out.append(WeightInfo(w.sources[0], w.qtype, w.rows, w.cols, op.layer, part))
    return out


@dataclass(frozen=True)
class HeadSplit:
    """The output head stored as two row sets: the `hot` tokens' rows at the head's planned type, every other
    row at `cold`. A step's logits are mostly decided by a few thousand likely tokens; the rest of a 49K
    vocabulary can take coarser rows for little KL (measured per split, precision/analysis.py)."""

    hot: tuple[int, ...]  # token ids, ascending
    cold: QuantType

    def __post_init__(self) -> None:
        if list(self.hot) != sorted(set(self.hot)):
            raise EllmError("precision plan: the head's hot token ids must be ascending and distinct")

    def describe(self) -> str:
        return f"output head split: {len(self.hot)} likeliest tokens' rows at the head's type, the rest at {self.cold.name}"

    def cold_ids(self, vocab: int) -> tuple[int, ...]:
        hot = set(self.hot)
        return tuple(i for i in range(vocab) if i not in hot)

    def nbytes(self, info: WeightInfo, hot_type: QuantType) -> int:
        """Bytes a step reads: both row sets and the int32 index that restores token order."""
        n = len(self.hot)
        rows = n * FORMATS[hot_type].row_bytes(info.cols) + (info.rows - n) * FORMATS[self.cold].row_bytes(info.cols)
        return rows + 4 * info.rows

    def fits(self, info: WeightInfo, hot_type: QuantType) -> bool:
        """Both row sets can be stored: ids in the vocabulary, a cold type below the hot one, and row counts
        the head's layout takes (whole 16-row tiles where the unsplit head has them)."""
        n = len(self.hot)
        if not 0 < n < info.rows or self.hot[0] < 0 or self.hot[-1] >= info.rows or bits(self.cold) >= bits(hot_type):
            return False
        if self.cold not in info.candidates():
            return False
        return all(tiled_supported(t, r, info.cols) or not tiled_supported(info.source, info.rows, info.cols)
                   for t, r in ((hot_type, n), (self.cold, info.rows - n)))


@dataclass(frozen=True)
class PrecisionPlan:
    """Storage types chosen for a model. `weights` lists only the tensors stored below their source type;
    `kv_k`/`kv_v` give each layer's cache type (None: the compile's KV options decide)."""

    weights: tuple[tuple[str, QuantType], ...] = ()
    kv_k: tuple[KVType, ...] | None = None
    kv_v: tuple[KVType, ...] | None = None
    activations: str | None = None  # "int16" / "int8" for steps and chunks alike; None: the compile's option
    origin: str = "source"  # how it was made: "source", "quant-level 2", "auto: ..."
    notes: tuple[str, ...] = ()
    predicted_kl: float | None = None  # sum of the measured single-part KLs of its choices (auto plans)
    summary: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)  # analysis summary for the manifest
    head_split: HeadSplit | None = None  # the head's rows in two sets; None: one type for all
    reads: tuple[int, ...] | None = None  # per layer, the remote blocks a sparse query reads; None: the default

    def __post_init__(self) -> None:
        if self.reads is not None and (min(self.reads, default=0) < 0 or (self.kv_k is not None and len(self.reads) != len(self.kv_k))):
            raise EllmError("precision plan: reads need one top-K >= 0 per layer")
        if (self.kv_k is None) != (self.kv_v is None) or (self.kv_k is not None and len(self.kv_k) != len(self.kv_v)):
            raise EllmError("precision plan: K and V cache types need one entry per layer each")
        if self.activations not in (None, "int16", "int8"):
            raise EllmError(f"precision plan: activations must be int16 or int8, got {self.activations!r}")
        names = [n for n, _ in self.weights]
        if len(set(names)) != len(names):
            raise EllmError("precision plan: a weight is listed twice")

    @property
    def weight_types(self) -> dict[str, QuantType]:
        return dict(self.weights)

    def type_of(self, info: WeightInfo) -> QuantType:
        return self.weight_types.get(info.name, info.source)

    def check(self, infos: Iterable[WeightInfo], n_layers: int) -> None:
        """Every listed weight exists and is lowered to one of its candidates."""
        by_name = {i.name: i for i in infos}
        for name, t in self.weights:
            info = by_name.get(name)
            if info is None:
                raise EllmError(f"precision plan: the model has no weight {name}")
            if t not in info.candidates():
                raise EllmError(f"precision plan: {name} ({info.source.name}, {info.rows}x{info.cols}) cannot be stored as "
                                f"{t.name}; its candidates are {', '.join(c.name for c in info.candidates())}")
        if self.kv_k is not None and len(self.kv_k) != n_layers:
            raise EllmError(f"precision plan: {len(self.kv_k)} KV layers for a model of {n_layers}")
        if self.head_split is not None:
            head = next(i for i in by_name.values() if i.part == "head")
            if not self.head_split.fits(head, self.type_of(head)):
                raise EllmError(f"precision plan: the head ({head.rows} rows, {self.type_of(head).name}) cannot be split "
                                f"into {len(self.head_split.hot)} hot rows and the rest at {self.head_split.cold.name}")

    def weight_bytes(self, infos: Iterable[WeightInfo]) -> int:
        """Bytes of the planned weights (a step reads each once)."""
        split = self.head_split
        return sum(split.nbytes(i, self.type_of(i)) if split is not None and i.part == "head" else i.nbytes(self.type_of(i))
                   for i in infos)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"origin": self.origin, "weights": {n: t.name for n, t in self.weights}}
        if self.kv_k is not None:
            d["kv_k"] = [t.value for t in self.kv_k]
            d["kv_v"] = [t.value for t in self.kv_v]
        if self.activations is not None:
            d["activations"] = self.activations
        if self.predicted_kl is not None:
            d["predicted_kl"] = self.predicted_kl
        if self.head_split is not None:
            d["head_split"] = {"cold": self.head_split.cold.name, "hot_rows": len(self.head_split.hot),
                               "hot": list(self.head_split.hot)}
        if self.reads is not None:
            d["reads"] = list(self.reads)
        if self.notes:
            d["notes"] = list(self.notes)
        if self.summary:
            d["analysis"] = self.summary
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> PrecisionPlan:
        kv_k = tuple(KVType(t) for t in d["kv_k"]) if "kv_k" in d else None
        kv_v = tuple(KVType(t) for t in d["kv_v"]) if "kv_v" in d else None
        split = d.get("head_split")
        head = HeadSplit(tuple(int(i) for i in split["hot"]), QuantType[split["cold"]]) if split else None
        return cls(tuple((n, QuantType[t]) for n, t in d.get("weights", {}).items()), kv_k, kv_v, d.get("activations"),
                   d.get("origin", "source"), tuple(d.get("notes", ())), d.get("predicted_kl"), d.get("analysis", {}),
                   head, tuple(int(k) for k in d["reads"]) if "reads" in d else None)


@dataclass(frozen=True)
class Budget:
    """Bytes read per decoded token at `ctx`: `mb` (10^6 bytes) outright, or `ratio` of the source plan's
    (source weights, the rule-based KV plan; the cache types given replace it on their side)."""

    mb: float | None = None
    ratio: float | None = None
    ctx: int = 8192

    def __post_init__(self) -> None:
        if self.mb is not None and self.ratio is not None:
            raise EllmError("give --budget-mb or --budget-ratio, not both")
        if (self.mb is not None and not self.mb > 0) or (self.ratio is not None and not self.ratio > 0):
            raise EllmError(f"the byte budget must be positive, got {self.mb if self.mb is not None else self.ratio}")
        if self.ctx < 1:
            raise EllmError(f"--budget-ctx must be positive, got {self.ctx}")

    def bytes(self, source_bytes: int) -> int:
        if self.mb is not None:
            return int(self.mb * 1e6)
        return int((1.0 if self.ratio is None else self.ratio) * source_bytes)
