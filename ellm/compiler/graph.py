"""The graph IR: a networkx DiGraph of typed op nodes, with shapes and dtypes, that passes rewrite."""

from __future__ import annotations

import enum
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Iterator

import networkx as nx

from ..quant import FORMATS, QuantType

# The number of new tokens in a step is symbolic in the graph; lowering binds it.
T = "T"


class OpKind(str, enum.Enum):
    INPUT = "input"  # tokens [T], positions, KV cache
    EMBEDDING = "embedding"  # [T] ids -> [T, d_model]
    RMSNORM = "rmsnorm"
    MATMUL = "matmul"  # y = x @ W.T (+ bias); W packed, dequantised inside the kernel
    ROPE = "rope"
    KV_APPEND = "kv_append"  # write K, V rows at positions pos..pos+T-1 of one layer's cache
    ATTENTION = "attention"  # causal GQA over the cache
    SILU_MUL = "silu_mul"
    ADD = "add"
    LM_HEAD = "lm_head"  # the vocabulary projection (a matmul, kept distinct for entry points)
    ROPE_KV_APPEND = "rope_kv_append"  # fused: rotate q and k, append k and v, emit rotated q
    FFN = "ffn"  # fused: x + down(silu(gate(norm(x))) * up(norm(x)))
    ATTN_INPUT = "attention_input"  # fused: norm, QKV projection, RoPE, KV append -> rotated q, cache
    VOCAB_MERGE = "vocab_merge"  # the logits of a head split into row sets -> [T, vocab] in token order
    ALLREDUCE = "allreduce"  # tensor parallelism: the sum of every rank's partial [T, width] (parallel/ccl.py)
    ALLGATHER = "allgather"  # tensor parallelism: every rank's [T, width_r], concatenated along the last axis


@dataclass(frozen=True)
class TensorType:
    shape: tuple[int | str, ...]
    dtype: str = "float32"

    @property
    def width(self) -> int:
        """Size of the last (feature) dimension."""
        return int(self.shape[-1])


@dataclass(frozen=True)
class Use:
    """An op input: output `index` of node `src`, optionally only columns [start, stop) of it."""

    src: str
    cols: tuple[int, int] | None = None
    index: int = 0


LAYOUTS = ("rows", "tile16")


@dataclass(frozen=True)
class WeightRef:
    """A packed weight of `rows` x `cols`, the row-concatenation of GGUF tensors `sources`.

    `layout` is how its components are arranged in memory: "rows" (GGUF blocks split into typed arrays,
    quant/formats.py) or "tile16" (16 rows interleaved, quant/tiled.py); the layout phase chooses it.
    `row_ids`: only these rows of the row-concatenation of `sources`, in this order (a split vocabulary head's
    row set, a tensor-parallel rank's heads); `source_rows`: the rows of that concatenation, where known (fusing
    row-selected weights needs it). `col_range`: only these columns of every source (a row-parallel matmul's
    slice), cut at block boundaries.
    """

    name: str
    qtype: QuantType
    rows: int
    cols: int
    sources: tuple[str, ...]
    layout: str = "rows"
    row_ids: tuple[int, ...] | None = None
    source_rows: int | None = None
    col_range: tuple[int, int] | None = None

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown weight layout {self.layout!r}")
        if self.row_ids is not None and (len(self.row_ids) != self.rows
                                         or (self.source_rows is None and len(self.sources) != 1)):
            raise ValueError(f"{self.name}: row_ids select {self.rows} rows (of several sources: give source_rows)")
        if self.source_rows is not None and self.row_ids is not None and max(self.row_ids) >= self.source_rows:
            raise ValueError(f"{self.name}: row_ids beyond the sources' {self.source_rows} rows")
        if self.col_range is not None:
            c0, c1 = self.col_range
            block = FORMATS[self.qtype].block
            if not (0 <= c0 < c1 and c1 - c0 == self.cols and c0 % block == 0 and c1 % block == 0):
                raise ValueError(f"{self.name}: columns {self.col_range} are not {self.cols} columns cut at "
                                 f"{self.qtype.name} blocks of {block}")

    @property
    def selected_rows(self) -> tuple[int, ...]:
        """Rows of the row-concatenation of `sources` this weight holds, in order."""
        return self.row_ids if self.row_ids is not None else tuple(range(self.rows))

    @property
    def nbytes(self) -> int:
        """Bytes of the quantised weight (GGUF accounting; layouts keep the same bits per weight)."""
        return FORMATS[self.qtype].row_bytes(self.cols) * self.rows


@dataclass(frozen=True)
class VectorRef:
    """A vector parameter: float32 (norm gain, bias), the concatenation of GGUF tensors `sources`; or a
    constant the compiler computed (`values`, e.g. an int32 index)."""

    name: str
    size: int
    sources: tuple[str, ...]
    dtype: str = "float32"
    values: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if (self.values is None) == (not self.sources) or (self.values is not None and len(self.values) != self.size):
            raise ValueError(f"{self.name}: a vector comes from GGUF sources or is `size` constant values")


def attrs(**kw: Any) -> tuple[tuple[str, Any], ...]:
    """Op attributes in canonical (sorted) order, so equal ops compare and hash equal."""
    return tuple(sorted(kw.items()))


@dataclass(frozen=True)
class Op:
    kind: OpKind
    outs: tuple[TensorType, ...]
    inputs: tuple[Use, ...] = ()
    weights: tuple[WeightRef, ...] = ()  # packed weights the op reads (most ops: none or one)
    vectors: tuple[tuple[str, VectorRef], ...] = ()  # role -> vector ("norm", "bias")
    attrs: tuple[tuple[str, Any], ...] = ()
    layer: int | None = None

    @property
    def out(self) -> TensorType:
        return self.outs[0]

    @property
    def weight(self) -> WeightRef | None:
        """The op's (first) weight."""
        return self.weights[0] if self.weights else None

    def attr(self, name: str, default: Any = None) -> Any:
        return dict(self.attrs).get(name, default)

    def vector(self, role: str) -> VectorRef | None:
        return dict(self.vectors).get(role)

    def with_attrs(self, **kw: Any) -> Op:
        merged = dict(self.attrs)
        merged.update(kw)
        return replace(self, attrs=tuple(sorted(merged.items())))


@dataclass
class Graph:
    """Op nodes keyed by name; edges run producer -> consumer. Node order of insertion is kept."""

    g: nx.DiGraph = field(default_factory=nx.DiGraph)
    outputs: list[str] = field(default_factory=list)

    # --- construction and rewriting -------------------------------------------------------
    def add(self, name: str, op: Op) -> str:
        if name in self.g:
            raise ValueError(f"duplicate node {name}")
        for u in op.inputs:
            if u.src not in self.g:
                raise ValueError(f"{name}: unknown input {u.src}")
        self.g.add_node(name, op=op)
        for u in op.inputs:
            self.g.add_edge(u.src, name)
        return name

    def op(self, name: str) -> Op:
        return self.g.nodes[name]["op"]

    def set_op(self, name: str, op: Op) -> None:
        """Replace a node's op, rewiring its input edges."""
        for u in op.inputs:
            if u.src not in self.g:
                raise ValueError(f"{name}: unknown input {u.src}")
        for src in list(self.g.predecessors(name)):
            self.g.remove_edge(src, name)
        self.g.nodes[name]["op"] = op
        for u in op.inputs:
            self.g.add_edge(u.src, name)

    def insert_after(self, src: str, name: str, op: Op) -> str:
        """Add `op` (which reads `src`) as `name`, and point every other use of `src`, and the outputs, at it."""
        users = self.consumers(src)
        self.add(name, op)
        for c in users:
            cop = self.op(c)
            self.set_op(c, replace(cop, inputs=tuple(Use(name, u.cols, 0) if u.src == src else u for u in cop.inputs)))
        self.outputs = [name if o == src else o for o in self.outputs]
        return name

    def remove(self, name: str) -> None:
        if any(True for _ in self.g.successors(name)):
            raise ValueError(f"cannot remove {name}: it still has consumers")
        self.g.remove_node(name)

    def consumers(self, name: str) -> list[str]:
        return list(self.g.successors(name))

    def replace_uses(self, old: str, new: str, *, cols_offset: int | None = None, index: int | None = None) -> None:
        """Point every use of `old` at `new`.

        With `cols_offset`, `old`'s output is the columns of `new`'s output starting there; with
        `index`, it is `new`'s output number `index`.
        """
        for c in self.consumers(old):
            op = self.op(c)
            ins = []
            for u in op.inputs:
                if u.src != old:
                    ins.append(u)
                elif cols_offset is not None:
                    width = self.op(old).outs[u.index].width
                    start, stop = u.cols if u.cols else (0, width)
                    ins.append(Use(new, (cols_offset + start, cols_offset + stop)))
                else:
                    ins.append(Use(new, u.cols, u.index if index is None else index))
            self.set_op(c, replace(op, inputs=tuple(ins)))
        self.outputs = [new if o == old else o for o in self.outputs]

    # --- queries ---------------------------------------------------------------------------
    def nodes(self) -> Iterator[tuple[str, Op]]:
        """Nodes in a topological order that keeps insertion order where dependencies allow."""
        order = {n: i for i, n in enumerate(self.g.nodes)}
        for n in nx.lexicographical_topological_sort(self.g, key=lambda n: order[n]):
            yield n, self.op(n)

    def names(self, kind: OpKind | None = None) -> list[str]:
        """A snapshot of node names (topological), optionally of one kind: safe to iterate while rewriting."""
        return [n for n, op in self.nodes() if kind is None or op.kind is kind]

    def input_type(self, use: Use) -> TensorType:
        t = self.op(use.src).outs[use.index]
        if use.cols is None:
            return t
        return TensorType(t.shape[:-1] + (use.cols[1] - use.cols[0],), t.dtype)

    def copy(self) -> Graph:
        return Graph(self.g.copy(), list(self.outputs))

    # --- whole-graph facts passes record (e.g. the NUMA plan), kept by copy() ------------------------
    def set_meta(self, key: str, value: Any) -> None:
        self.g.graph[key] = value

    def meta(self, key: str, default: Any = None) -> Any:
        return self.g.graph.get(key, default)

    def check(self) -> None:
        """Structural invariants every pass must keep."""
        if not nx.is_directed_acyclic_graph(self.g):
            raise AssertionError("graph has a cycle")
        for name, op in self.nodes():
            preds = set(self.g.predecessors(name))
            if preds != {u.src for u in op.inputs}:
                raise AssertionError(f"{name}: edges {preds} disagree with inputs {op.inputs}")
            for u in op.inputs:
                if not 0 <= u.index < len(self.op(u.src).outs):
                    raise AssertionError(f"{name}: output {u.index} of {u.src} does not exist")
                if u.cols is not None:
                    w = self.op(u.src).outs[u.index].width
                    if not 0 <= u.cols[0] < u.cols[1] <= w:
                        raise AssertionError(f"{name}: column slice {u.cols} outside width {w} of {u.src}")
        for o in self.outputs:
            if o not in self.g:
                raise AssertionError(f"output {o} is not a node")

    # --- summaries -------------------------------------------------------------------------
    def op_counts(self) -> Counter:
        return Counter(op.kind.value for _, op in self.nodes() if op.kind is not OpKind.INPUT)

    def weights(self) -> list[WeightRef]:
        seen: dict[str, WeightRef] = {}
        for _, op in self.nodes():
            for w in op.weights:
                seen.setdefault(w.name, w)
        return list(seen.values())

    def vector_params(self) -> list[VectorRef]:
        seen: dict[str, VectorRef] = {}
        for _, op in self.nodes():
            for _, v in op.vectors:
                seen.setdefault(v.name, v)
        return list(seen.values())
