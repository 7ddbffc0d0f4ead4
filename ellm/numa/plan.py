"""A NUMA layout plan: which rows of every matmul weight, and which KV heads, live on which node, and which
of a node's threads computes which rows, so that every thread reads only its own node's memory.

- The K and V heads are split into contiguous per-node ranges (per-head slices of the cache). In the fused
  Q/K/V weight a node computes the K and V rows of its heads, so the keys and values it appends are written
  to its own memory, and query heads (an activation, read by whichever node's attention needs it) even out
  the kernel: a node with more KV heads takes fewer query heads.
- Every other matmul's rows are split evenly into tile-aligned (16-row) contiguous ranges, the odd tiles going
  to the nodes with the fewest bytes so far. Each kernel is balanced on its own: the nodes' threads meet at
  the end of every kernel, so a kernel's time is its busiest node's, and moving rows into one kernel to make
  up for another would only lengthen it.
- Within a node, thread j of t takes units [floor(n j / t), floor(n (j + 1) / t)) of each of the node's
  ranges: a fixed task -> thread map (`tasks`).
- Vectors (norms), the embedding table (one row read per token) and activations are replicated or
  interleaved: they are small or read sparsely.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import EllmError
from .topology import Topology

TILE_ROWS = 16


@dataclass(frozen=True)
class WeightRows:
    """One matmul weight as the planner sees it: `units` row tiles of `unit_bytes` each (all its components).
    `heads`: for the fused Q/K/V weight, (n_heads, n_kv_heads, head_dim) to split it by KV head groups."""

    name: str
    units: int
    unit_bytes: float
    heads: tuple[int, int, int] | None = None

    @property
    def nbytes(self) -> float:
        return self.units * self.unit_bytes


@dataclass(frozen=True)
class MatrixSplit:
    name: str
    ranges: tuple[tuple[tuple[int, int], ...], ...]  # [node] -> unit ranges [start, end), tile units
    unit_bytes: float

    def units(self, node: int) -> int:
        return sum(b - a for a, b in self.ranges[node])


@dataclass(frozen=True)
class NumaPlan:
    nodes: tuple[int, ...]  # NUMA node ids, in plan order
    cpus: tuple[tuple[int, ...], ...]  # [node] -> the CPUs whose threads run its tasks (one per core)
    matrices: tuple[MatrixSplit, ...]
    kv_heads: tuple[tuple[int, int], ...]  # [node] -> KV head range [start, end)

    def bytes_per_node(self) -> list[float]:
        return [sum(m.units(k) * m.unit_bytes for m in self.matrices) for k in range(len(self.nodes))]

    def imbalance(self) -> float:
        """Largest node's bytes over the mean, less 1."""
        b = self.bytes_per_node()
        mean = sum(b) / len(b)
        return max(b) / mean - 1 if mean else 0.0

    def matrix(self, name: str) -> MatrixSplit:
        for m in self.matrices:
            if m.name == name:
                return m
        raise KeyError(name)

    def tasks(self, name: str) -> list[tuple[int, int, tuple[tuple[int, int], ...]]]:
        """The fixed task -> thread map of one matrix: (node id, CPU, unit ranges) per thread, node by node."""
        m = self.matrix(name)
        out = []
        for k, cpus in enumerate(self.cpus):
            for j, cpu in enumerate(cpus):
                mine = []
                for a, b in m.ranges[k]:
                    n = b - a
                    lo, hi = a + n * j // len(cpus), a + n * (j + 1) // len(cpus)
                    if hi > lo:
                        mine.append((lo, hi))
                out.append((self.nodes[k], cpu, tuple(mine)))
        return out

    @classmethod
    def from_dict(cls, d: dict, weights: list[WeightRows], cpus: tuple[tuple[int, ...], ...]) -> NumaPlan:
        """A plan recorded by to_dict (the manifest's, compiled for a node count), for the matrices of
        `weights` (one target's; their unit bytes), run by `cpus` ([node] -> CPUs)."""
        ranges = d["matrices"]
        missing = [w.name for w in weights if w.name not in ranges]
        if missing:
            raise EllmError(f"the artifact's NUMA plan lacks {len(missing)} matrices ({missing[0]}, ...)")
        matrices = tuple(MatrixSplit(w.name, tuple(tuple(tuple(r) for r in rs) for rs in ranges[w.name]), w.unit_bytes)
                         for w in weights)
        return cls(tuple(d["nodes"]), cpus, matrices, tuple(tuple(r) for r in d["kv_heads"]))

    def to_dict(self) -> dict:
        return {"nodes": list(self.nodes), "cpus": [list(c) for c in self.cpus],
                "kv_heads": [list(r) for r in self.kv_heads], "bytes_per_node": [round(b) for b in self.bytes_per_node()],
                "matrices": {m.name: [[list(r) for r in rs] for rs in m.ranges] for m in self.matrices}}


def split_heads(n: int, parts: int) -> list[tuple[int, int]]:
    """n heads into `parts` contiguous ranges differing by at most one (the first ones larger)."""
    base, extra = divmod(n, parts)
    out, at = [], 0
    for k in range(parts):
        size = base + (k < extra)
        out.append((at, at + size))
        at += size
    return out


def _qkv_ranges(w: WeightRows, kv: list[tuple[int, int]]) -> list[tuple[tuple[int, int], ...]]:
    """The fused Q/K/V weight's rows per node: its query heads, then the keys and values of its KV heads. The
    query heads make each node's heads (q, k and v) as even as whole heads allow."""
    n_heads, n_kv, head_dim = w.heads
    if head_dim % TILE_ROWS:
        raise EllmError(f"{w.name}: heads of {head_dim} rows do not split into {TILE_ROWS}-row tiles")
    per = head_dim // TILE_ROWS  # tile units per head
    q_units, k_units = n_heads * per, n_kv * per
    if q_units + 2 * k_units != w.units:
        raise EllmError(f"{w.name}: {w.units} tiles is not Q + K + V of {n_heads} + 2 x {n_kv} heads")
    mean = (n_heads + 2 * n_kv) / len(kv)
    q = _shares(n_heads, [max(0.0, mean - 2 * (b - a)) for a, b in kv])
    out, at = [], 0
    for (a, b), n in zip(kv, q):
        rs = [(at * per, (at + n) * per), (q_units + a * per, q_units + b * per),
              (q_units + k_units + a * per, q_units + k_units + b * per)]
        out.append(tuple(r for r in rs if r[1] > r[0]))
        at += n
    return out


def _shares(total: int, weights: list[float]) -> list[int]:
    """`total` whole units in proportion to `weights` (evenly where they are all 0), largest remainders up."""
    s = sum(weights)
    exact = [total * x / s for x in weights] if s > 0 else [total / len(weights)] * len(weights)
    counts = [int(x) for x in exact]
    for k in sorted(range(len(weights)), key=lambda k: (counts[k] - exact[k], k))[: total - sum(counts)]:
        counts[k] += 1
    return counts


def _even_split(units: int, totals: list[float]) -> list[int]:
    """Units per node summing to `units`: an equal share each, the odd units to the nodes with the fewest
    bytes so far (`totals`)."""
    base, extra = divmod(units, len(totals))
    counts = [base] * len(totals)
    for k in sorted(range(len(totals)), key=lambda k: (totals[k], k))[:extra]:
        counts[k] += 1
    return counts


def plan_layout(weights: list[WeightRows], n_kv_heads: int, topology: Topology, nodes: list[int] | None = None,
                allowed: set[int] | None = None) -> NumaPlan:
    """The plan for `weights` over `nodes` of `topology` (default: every node with CPUs), each node's threads
    one per physical core (of `allowed` CPUs)."""
    use = [n for n in topology.nodes if (nodes is None and n.cpus) or (nodes is not None and n.id in nodes)]
    if not use:
        raise EllmError("no NUMA node with CPUs to plan for")
    cpus = tuple(tuple(topology.physical_cores(allowed, {n.id})) for n in use)
    if any(not c for c in cpus):
        raise EllmError("a NUMA node in the plan has no CPU this process may use")
    kv = split_heads(n_kv_heads, len(use))
    totals = [0.0] * len(use)
    splits = {}
    for w in sorted(weights, key=lambda w: w.name):  # one order whatever the caller's: the graph's or the records'
        if w.heads is not None:
            ranges = _qkv_ranges(w, kv)
        else:
            counts = _even_split(w.units, totals)
            ranges, at = [], 0
            for c in counts:
                ranges.append(((at, at + c),) if c else ())
                at += c
        split = MatrixSplit(w.name, tuple(ranges), w.unit_bytes)
        for k in range(len(use)):
            totals[k] += split.units(k) * w.unit_bytes
        splits[w.name] = split
    return NumaPlan(tuple(n.id for n in use), cpus, tuple(splits[w.name] for w in weights), tuple(kv))


def rows_per_unit(record: dict) -> int:
    """First-dimension entries of a parameter record per planning unit: a tiled record's entries are 16-row
    tiles already, a row-major record's are rows."""
    return 1 if record.get("layout") == "tile16" else TILE_ROWS


def record_units(record: dict) -> int:
    """Planning units (16-row tiles) of a parameter record, a last partial tile included."""
    return -(-record["shape"][0] // rows_per_unit(record))


def weights_of_manifest(manifest: dict) -> list[WeightRows]:
    """The matmul weights of an artifact (all its parameter records: weights_of_params)."""
    return weights_of_params(manifest["params"], manifest["config"])


def weights_of_params(records: list[dict], cfg: dict) -> list[WeightRows]:
    """The matmul weights of parameter records (one target's): components grouped by weight; tiled ones count
    their tiles, row-major ones their rows in 16-row units. Vectors are left out (replicated), and so is the
    embedding table where it is only gathered (one row per token): where the head is tied to it and not
    split into a table of its own, the table is the head's matmul and is planned as one."""
    groups: dict[str, list[dict]] = {}
    for p in records:
        groups.setdefault(p["name"].split(":")[0], []).append(p)
    own_head = "output.weight" in groups or any(n.startswith("token_embd.weight.") for n in groups)
    gathered_only = {"lm_head.index"} | ({"token_embd.weight"} if own_head or not cfg.get("tied_embeddings") else set())
    out = []
    for name, comps in groups.items():
        lead = comps[0]
        if len(lead["shape"]) < 2 or name in gathered_only:
            continue
        units = record_units(lead)
        heads = None
        if "attn_q+attn_k+attn_v" in name:
            heads = (cfg["n_heads"], cfg["n_kv_heads"], cfg["head_dim"])
        out.append(WeightRows(name, units, sum(c["nbytes"] for c in comps) / units, heads))
    return out
