"""Placement at load: the weights and the KV cache put on the NUMA nodes whose threads read them, threads
pinned, memory optionally locked. The engine's one entry into NUMA (runtime/engine.py).

Weights (without --mmap): a private copy on 2 MiB pages; each matmul's row ranges bound (mbind MPOL_BIND) to
the node the layout plan gives them, then copied in by a thread pinned to that node (first touch lands on
the node even where binding is refused); vectors and the embedding table interleaved over the nodes in use.
With --mmap: the file's page cache, shared with other processes and left where the kernel put it.
KV cache: every layer's per-head slices bound to the node of their heads ([layer, head, ...] tensors).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace
from typing import Callable

import numpy as np

from ..errors import EllmError
from ..runtime.hugepages import HUGE
from . import memory
from .plan import NumaPlan, plan_layout, record_units, rows_per_unit, weights_of_params
from .threadmap import NUMA_MODES, ThreadMap, current_cpu, thread_map
from .topology import Topology, allowed_cpus, read_topology


@dataclass(frozen=True)
class NumaOptions:
    """`mode`: a --numa mode, or None: distribute on a machine with several nodes, none on one.
    `mlock`: lock weights and KV cache in memory. `mmap`: weights stay the file's shared memory map.
    `pseudo_nodes`: split the cores into simulated nodes (Topology.pseudo). `cpus`: run on exactly these CPUs
    instead of the process's mask (a tensor-parallel rank: its node's cores; parallel/worker.py)."""

    mode: str | None = None
    mlock: bool = False
    mmap: bool = False
    pseudo_nodes: int = 0  # >1: split the cores into this many simulated nodes (memory on the real ones)
    cpus: tuple[int, ...] = ()

    def __post_init__(self):
        if self.mode is not None and self.mode not in NUMA_MODES:
            raise EllmError(f"--numa must be one of {', '.join(NUMA_MODES)}, got {self.mode!r}")
        if self.pseudo_nodes < 0:
            raise EllmError(f"--numa-pseudo-nodes must be positive, got {self.pseudo_nodes}")

    def resolved(self, topology: Topology) -> str:
        if self.mode is not None:
            return self.mode
        return "distribute" if sum(1 for n in topology.nodes if n.cpus) > 1 else "none"


@dataclass
class Placement:
    """What load did: the thread map and plan (None for --numa none), and what each buffer got."""

    options: NumaOptions
    mode: str
    n_threads: int
    threads: ThreadMap | None
    plan: NumaPlan | None
    bound_bytes: int = 0
    locked_bytes: int = 0
    warnings: list[str] = field(default_factory=list)
    regions: list[tuple[str, np.ndarray]] = field(default_factory=list)  # (what, array) placed or locked
    locked: int = 0  # regions[:locked] are locked
    weights: str = "copy"  # copy: private, on huge pages (placed where a plan is); mmap: the file's page cache
    memory_nodes: dict[int, int] = field(default_factory=dict)  # plan node -> memory node bound (pseudo-nodes)
    plan_origin: str | None = None  # "artifact": compiled for this node count (--numa-nodes); "load": planned here
    # whether the kernels run the plan's task -> thread map (kernel_tasks): "planned" (all that read a node's
    # rows), "partial" (some keep TVM's static split), "static" (none, or compiled for other threads per node)
    kernel_tasks: str = "static"

    @classmethod
    def make(cls, options: NumaOptions, threads: int | None, manifest: dict, records: list[dict],
             topology: Topology | None = None, allowed: set[int] | None = None,
             start_cpu: int | None = None, kernels: list[dict] = (), log: Callable[[str], None] | None = None) -> Placement:
        """`kernels`: the manifest's kernel records of the target that runs (which follow a compiled plan)."""
        topology = topology or read_topology()
        memory_nodes = {n.id: n.id for n in topology.nodes}
        if options.pseudo_nodes > 1:
            topology, memory_nodes = topology.pseudo(options.pseudo_nodes)
        allowed = allowed if allowed is not None else (set(options.cpus) or allowed_cpus())
        mode = options.resolved(topology)
        if start_cpu is None:
            start_cpu = options.cpus[0] if options.cpus else current_cpu()
        if threads is None:  # physical cores: of the start node when isolated, else of every allowed CPU
            home = {topology.node_of_cpu(start_cpu)} if mode == "isolate" else None
            threads = len(topology.physical_cores(allowed, home)) or 1
        tmap = thread_map(mode, int(threads), topology, allowed, start_cpu)
        plan, origin, tasks, notes = None, None, "static", []
        if tmap is not None:
            nodes = list(tmap.node_ids())
            weights = weights_of_params(records, manifest["config"])
            cpus = tuple(tmap.cpus_of(n) for n in nodes)
            compiled = manifest.get("numa")
            if compiled is not None and len(compiled["nodes"]) == len(nodes):
                # the artifact's layout for this many nodes: its k-th node is the k-th node in use here
                plan, origin = replace(NumaPlan.from_dict(compiled, weights, cpus), nodes=tuple(nodes)), "artifact"
                tasks, notes = planned_kernels(compiled, kernels, cpus)
            else:
                plan = plan_layout(weights, manifest["config"]["n_kv_heads"], topology, nodes=nodes, allowed=allowed)
                plan, origin = replace(plan, cpus=cpus), "load"
        placement = cls(options, mode, int(threads), tmap, plan, memory_nodes=memory_nodes, plan_origin=origin,
                        kernel_tasks=tasks)
        for msg in notes:
            placement._warn(msg, log or (lambda s: None))
        return placement

    @property
    def cpus(self) -> tuple[int, ...] | None:
        return self.threads.cpus if self.threads is not None else None

    @property
    def binding(self) -> bool:
        """Whether memory is bound here (distribute, isolate); numactl leaves it to the process policy."""
        return self.plan is not None and self.mode in ("distribute", "isolate")

    def _warn(self, msg: str, log: Callable[[str], None]) -> None:
        if msg not in self.warnings:
            self.warnings.append(msg)
            log(f"warning: {msg}")

    def _bind_pages(self, a: np.ndarray, wants: list[tuple[int, int, int | None]], log) -> None:
        """Bind `a` (2 MiB aligned, huge pages) as `wants` ([start, stop) bytes -> plan node, None: interleaved)
        say, a huge page at a time: each goes to the memory node owning most of its bytes, and consecutive
        pages of one node are bound in one call. (A huge page lives on one node anyway, and binding each range
        apart splits the mapping into thousands of areas whose unaligned edges cannot be huge pages.)"""
        if not self.binding:
            return
        base = a.ctypes.data
        first = base // HUGE  # huge pages by absolute address: `a` need not start on one
        owned: list[dict] = [{} for _ in range((base + a.nbytes - 1) // HUGE - first + 1)]
        for start, stop, node in wants:
            mem = "interleave" if node is None and len(self.memory_node_ids) > 1 else (
                self.memory_node_ids[0] if node is None else self.memory_nodes.get(node, node))
            at = start
            while at < stop:
                page = (base + at) // HUGE
                end = min(stop, (page + 1) * HUGE - base)
                owned[page - first][mem] = owned[page - first].get(mem, 0) + end - at
                at = end
        owner = [max(o, key=o.get) if o else None for o in owned]
        i = 0
        while i < len(owner):
            last = i
            while last + 1 < len(owner) and owner[last + 1] == owner[i]:
                last += 1
            if owner[i] is not None:
                lo = max(0, (first + i) * HUGE - base)
                hi = min(a.nbytes, (first + last + 1) * HUGE - base)
                interleave = owner[i] == "interleave"
                nodes = self.memory_node_ids if interleave else [owner[i]]
                addr, length = memory.inner_span(a, lo, hi)
                try:
                    memory.bind(addr, length, nodes, memory.MPOL_INTERLEAVE if interleave else memory.MPOL_BIND)
                except memory.PlacementUnavailable as e:
                    self._warn(f"NUMA binding unavailable ({e.strerror or e}); memory follows first touch", log)
                    return
                self.bound_bytes += length
            i = last + 1

    @property
    def memory_node_ids(self) -> list[int]:
        """The real memory nodes of the plan's nodes."""
        return sorted({self.memory_nodes.get(n, n) for n in self.plan.nodes})

    def keep_mapped(self, mm: np.ndarray, log: Callable[[str], None]) -> np.ndarray:
        """The weights stay the file's memory map `mm` (--mmap): shared page cache, placed by the kernel, not
        here (--mlock still locks it)."""
        self.weights = "mmap"
        if self.binding:
            self._warn("--mmap: the weights are the shared page cache and are not placed on NUMA nodes", log)
        self.regions.append(("weights", mm))
        return mm

    # --- weights ------------------------------------------------------------------------------
    def node_ranges(self, record: dict) -> list[tuple[int, list[tuple[int, int]]]]:
        """(node, [byte ranges]) of one parameter component: its matrix's rows per node, or [] where the
        plan does not split it (vectors, the gathered embedding table)."""
        if self.plan is None:
            return []
        try:
            split = self.plan.matrix(record["name"].split(":")[0])
        except KeyError:
            return []
        rows, per_unit, units = record["shape"][0], rows_per_unit(record), record_units(record)
        per_row = record["nbytes"] // rows
        out = []
        for k, node in enumerate(self.plan.nodes):
            spans = [(a * per_unit * per_row, min(b * per_unit, rows) * per_row)
                     for a, b in split.ranges[k] if a < units]
            out.append((node, spans))
        return out

    def load_weights(self, mm: np.ndarray, records: list[dict], log: Callable[[str], None]) -> np.ndarray:
        """The weights file's bytes as the kernels will read them: a private copy on huge pages placed as the
        plan says, each node's rows copied in by a thread on that node."""
        from ..runtime.hugepages import huge_bytes

        whole = huge_bytes(mm.size)  # untouched: no page exists until the copies below
        jobs: dict[int | None, list[tuple[int, int]]] = {}
        wants: list[tuple[int, int, int | None]] = []
        for r in records:
            off, n = int(r["offset"]), int(r["nbytes"])
            ranges = self.node_ranges(r)
            if not ranges:  # replicated: interleaved over the nodes, copied here
                wants.append((off, off + n, None))
                jobs.setdefault(None, []).append((off, off + n))
                continue
            for node, spans in ranges:
                for a, b in spans:
                    wants.append((off + a, off + b, node))
                    jobs.setdefault(node, []).append((off + a, off + b))
        self._bind_pages(whole, wants, log)
        self._copy(whole, mm, jobs)
        self.regions.append(("weights", whole))
        return whole

    def _copy(self, dst: np.ndarray, src: np.ndarray, jobs: dict) -> None:
        """Each node's ranges copied by a thread pinned to that node's CPUs (first touch), the rest here."""
        import os

        def run(node, spans):
            if node is not None and self.threads is not None and hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, set(self.threads.cpus_of(node)))
            for a, b in spans:
                dst[a:b] = src[a:b]

        workers = [threading.Thread(target=run, args=(node, spans)) for node, spans in jobs.items() if node is not None]
        for t in workers:
            t.start()
        run(None, jobs.get(None, []))
        for t in workers:
            t.join()

    # --- KV cache -----------------------------------------------------------------------------
    def place_kv(self, arrays: list[np.ndarray], log: Callable[[str], None]) -> None:
        """Bind KV state tensors [layers, kv_heads, ...] by head: each layer's head range to its node. Call
        before the first write (the tensors are fresh, untouched memory)."""
        if self.binding and arrays:
            # one pass over the whole arena: binding tensor by tensor would split it at their (unaligned) edges
            lo = min(a.ctypes.data for a in arrays)
            span = _span(lo, max(a.ctypes.data + a.nbytes for a in arrays) - lo)
            wants = []
            for a in arrays:
                layers, heads = a.shape[0], a.shape[1]
                per_head = a.nbytes // (layers * heads)
                at = a.ctypes.data - lo
                wants += [(at + (layer * heads + h0) * per_head, at + (layer * heads + h1) * per_head, node)
                          for layer in range(layers) for node, (h0, h1) in zip(self.plan.nodes, self.plan.kv_heads)]
            self._bind_pages(span, wants, log)
        self.regions += [("kv", a) for a in arrays]

    # --- locking ------------------------------------------------------------------------------
    def lock(self, log: Callable[[str], None]) -> None:
        """mlock every placed region (--mlock); where the limit or the system refuses, one warning."""
        if not self.options.mlock:
            return
        for what, a in self.regions[self.locked :]:
            addr, length = memory.page_span(a)
            try:
                memory.lock(addr, length)
            except memory.PlacementUnavailable as e:
                limit = memory.memlock_limit()
                lim = "unlimited" if limit is None else f"{limit / 2**20:.0f} MiB"
                self._warn(f"--mlock: could not lock {what} ({e.strerror or e}; RLIMIT_MEMLOCK {lim}: raise it with "
                           "`ulimit -l` or run with CAP_IPC_LOCK); continuing unlocked", log)
                return
            self.locked_bytes += length
            self.locked += 1

    def summary(self) -> dict:
        """to_dict without the per-matrix ranges: what a run report carries."""
        d = self.to_dict()
        if d["plan"] is not None:
            d["plan"] = {k: v for k, v in d["plan"].items() if k != "matrices"} | {"imbalance": self.plan.imbalance()}
        return d

    def to_dict(self) -> dict:
        return {"mode": self.mode, "pseudo_nodes": self.options.pseudo_nodes, "mlock": self.options.mlock, "weights": self.weights, "n_threads": self.n_threads,
                "threads": self.threads.to_dict() if self.threads else None,
                "plan": self.plan.to_dict() if self.plan else None, "plan_origin": self.plan_origin,
                "kernel_tasks": self.kernel_tasks,
                "bound_bytes": self.bound_bytes, "locked_bytes": self.locked_bytes, "warnings": list(self.warnings)}


def planned_kernels(compiled: dict, kernels: list[dict], cpus: tuple[tuple[int, ...], ...]) -> tuple[str, list[str]]:
    """Whether the kernels of a plan compiled into the artifact run its tasks on these threads ([node] -> CPUs):
    ("planned" | "partial" | "static", warnings). A kernel's tasks are fixed at compile, one per thread."""
    marks = [k["numa_tasks"] for k in kernels if "numa_tasks" in k]
    if "planned" not in marks:
        return "static", []
    want = [len(c) for c in compiled["cpus"]]
    have = [len(c) for c in cpus]
    if want != have:
        return "static", [f"the artifact's kernels split their work for {want} threads per NUMA node, this process "
                          f"runs {have}: threads read other nodes' rows (ellm compile --numa-threads)"]
    return ("planned" if "static" not in marks else "partial"), []


def _span(addr: int, nbytes: int) -> np.ndarray:
    """A uint8 view of [addr, addr + nbytes): the memory of several arrays of one arena, as one range."""
    import ctypes

    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
