"""The one timing harness of the tuner and `bench/kernels.py`: a kernel alone, with inputs of its real shapes,
timed as a decode step sees it.

In a decode step every byte a one-token kernel streams (its weights; for attention, the KV blocks it reads)
is read once, and the rest of the step passes through the caches before the next step reads it again. So
its buffers rotate through copies until a timing pass reads what the whole step reads (`Workload.step_bytes`:
every weight and the KV blocks of every layer at the context), capped at COLD_CACHES times the last-level
cache, past which every read is cold. The reuse distance, not "always cold", is what deployment sees: on a
Sapphire Rapids VM whose 2 threads read 59 GB/s up to 64 MiB and 32 GB/s from DRAM, SmolLM2's ~100 MB step
is partly cache-resident (decode at 116% of the DRAM rate); timed cold, its kernels summed to 4.30 ms a step
against 2.70 ms measured, and the LM head's ranking of two points reversed between the two.
Kernels that read the KV cache step through the layers they serve, each with its own slots of the stores
(`kv_steps`); attention copies are counted by the blocks its sparse selection reads. Prefill chunks are
compute-bound and reuse their weights across tokens, so they are timed with one set. Times are medians of
three timed passes after an untimed one and include the Python call (~1 us).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from ..kv.attention import AttentionConfig
from ..kv.plan import KVPlan
from ..schedules import KernelRequest

# Copies of twice the L3 are not cold on Zen 5's victim L3: a 30 MB head read from two copies ran at 61-66 GB/s,
# from four or eight at 44-47 GB/s (this VM's DRAM rate), a 576x576 GEMV at 40 vs 30-34 GB/s.
COLD_CACHES = 4
# Cold copies may take at most this share of the machine's memory (with a 480 MB L3, SmolLM2's 4 q8-key layers
# read 2.6 MB a copy at 8K tokens: 740 copies of the 31 MB cache it is given); fewer copies read warmer.
COPY_MEMORY_SHARE = 0.25
WEIGHTS = ("w_", "gu_", "down_")  # packed weight components: what a decode step streams besides the KV cache
NOT_KV_STATE = ("q", "out", "attn")  # the buffers of an attention kernel that are not the cache
STEP_SCALARS = ("layer", "kslot", "vslot")  # which layer a KV kernel runs, and its slots in the typed stores


@dataclass(frozen=True)
class Workload:
    tokens: int = 256  # symbolic token count of prefill kernels
    ctx: int = 4096  # KV cache capacity; attention runs at the end of it
    layers: int = 1  # KV cache layers a kernel that reads the cache steps through, without a plan (kv_steps)
    step_bytes: int = 0  # bytes one decode step reads at `ctx` (decode_step_bytes); 0: unknown, one-token kernels read cold


def inputs(func, req: KernelRequest, wl: Workload, rng) -> list:
    """Random TVM arguments for every parameter of `func` (buffers and scalars)."""
    import tvm

    m = req.m if req.m is not None else wl.tokens
    key = req.attr("kv_plan")
    block = KVPlan.from_key(key).block if key else 64
    sizes = {"T": m, "n": m, "C": wl.ctx, "NB": -(-wl.ctx // block)}  # NB: KV cache blocks
    # a chunk ends at the cache's end and stores the blocks it completes; a one-token step stores a block
    # only once every `block` steps, so it is timed at a position that completes none
    pos = wl.ctx - m
    if m == 1 and (pos + 1) % block == 0:
        pos -= 1
    scalars = {"pos": pos, **kv_steps(req, wl.layers)[0]}  # the first layer it serves
    args = []
    for p in func.params:
        if not isinstance(p.ty, tvm.ir.PrimType):  # a buffer parameter
            shape = [int(d) if isinstance(d, (int, tvm.tirx.IntImm)) else sizes[str(d.name)] for d in p.shape]
            dtype = str(p.dtype)
            if str(p.name) == "attn":  # the run-time attention settings: the defaults, as a run has them
                arr = AttentionConfig().as_array(shape[0])
            elif dtype.startswith("float"):
                arr = (rng.standard_normal(shape) * 0.1).astype(dtype)
            elif dtype == "int32":  # token ids
                arr = np.zeros(shape, np.int32)
            else:  # packed quants, scales as raw bytes
                nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
                arr = rng.integers(0, 256, nbytes, dtype=np.uint8).view(dtype).reshape(shape)
            args.append(tvm.runtime.tensor(arr))
        else:
            args.append(scalars[str(p.name)])
    return args


def param_names(func) -> list[str]:
    return [str(p.name) for p in func.params]


def weight_bytes(func, args) -> int:
    """Bytes of the packed weight arguments (from shapes and dtypes: no copy of the data)."""
    return sum(tensor_bytes(x) for n, x in zip(param_names(func), args) if n.startswith(WEIGHTS))


def tensor_bytes(x) -> int:
    """Bytes of a TVM tensor, from its shape and dtype."""
    return int(np.prod(x.shape)) * np.dtype(str(x.dtype)).itemsize


def streamed(func, args) -> list[int]:
    """Indices of the buffers a decode step streams from DRAM: the packed weights; for a kernel without any
    that reads the KV cache (a `layer` argument), the cache's buffers (all but the query, the output and
    the settings): between two steps every other layer's weights and KV pass through the caches."""
    import tvm

    names = param_names(func)
    w = [i for i, n in enumerate(names) if n.startswith(WEIGHTS)]
    if w or "layer" not in names:
        return w
    return [i for i, (n, a) in enumerate(zip(names, args)) if isinstance(a, tvm.runtime.Tensor) and n not in NOT_KV_STATE]


def kv_steps(req: KernelRequest, layers: int = 1) -> list[dict[str, int]]:
    """The step scalars (layer, kslot, vslot) of every layer whose cache a kernel of `req` reads, in order: the
    layers the request's KV plan gives its K and V types, each with its slots in the stores of those types
    (without a plan, `layers` layers of one class)."""
    key = req.attr("kv_plan")
    if not key:
        return [{"layer": i, "kslot": i, "vslot": i} for i in range(layers)]
    plan = KVPlan.from_key(key)
    kt, vt = req.attr("kv_k"), req.attr("kv_v")
    steps = []
    for i in range(plan.n_layers):
        (tk, ks), (tv, vs) = plan.slot("k", i), plan.slot("v", i)
        if kt in (None, tk.value) and vt in (None, tv.value):
            steps.append({"layer": i, "kslot": ks, "vslot": vs})
    return steps


def kv_read_bytes(req: KernelRequest, wl: Workload) -> int | None:
    """Bytes of the KV stores a query of an attention kernel reads at the workload's context (as
    AttentionConfig's defaults select them, before widening), at the types of the first layer it serves
    (KVPlan.read_bytes). None for other kernels."""
    key = req.attr("kv_plan")
    if not key or req.kind.value != "attention":
        return None
    return KVPlan.from_key(key).read_bytes(wl.ctx, AttentionConfig(), kv_steps(req)[0]["layer"])


def decode_step_bytes(g, ctx: int) -> int:
    """Bytes one decode step of graph `g` reads at context `ctx`: every weight once (one embedding row) and
    the KV blocks every layer's attention reads with the default settings (KVPlan.read_bytes)."""
    from ..compiler.inspect import decode_weight_bytes

    plan = KVPlan.from_key(g.op("kv_cache").attr("kv_plan"))
    return decode_weight_bytes(g) + plan.read_bytes(ctx, AttentionConfig())


def reuse_bytes(wl: Workload, llc: int) -> int:
    """Bytes a one-token kernel's timing pass reads before it reads a byte again: what a decode step reads
    (`wl.step_bytes`), at most COLD_CACHES x `llc` (every read is cold by then); COLD_CACHES x `llc` where the
    step is unknown."""
    cold = COLD_CACHES * llc
    return min(wl.step_bytes, cold) if wl.step_bytes else cold


def argument_sets(func, args, reuse: int, steps: list[dict[str, int]] = (), read: int | None = None,
                  memory: int | None = None) -> list[list]:
    """The argument lists one timing pass cycles through. A kernel with a `layer` argument takes each of
    `steps` (kv_steps) in turn. With `reuse` > 0 (reuse_bytes), the streamed buffers are copied until a pass
    reads `reuse` bytes (`read`: bytes a call reads of them, default all), within COPY_MEMORY_SHARE of
    `memory`; 0: one set, read hot. With weights (each call reads all of a copy's), the copies are paired with
    the steps in turn, max(copies, steps) calls a pass; reading only the KV cache (a call reads one layer of a
    copy), every copy goes through every step, copies x steps calls, so no byte is read twice within a pass."""
    names = param_names(func)
    rot = streamed(func, args)
    nbytes = sum(tensor_bytes(args[i]) for i in rot)
    layered = "layer" in names and bool(steps)
    with_weights = any(names[i].startswith(WEIGHTS) for i in rot)
    per_copy = (read or nbytes) * (len(steps) if layered and not with_weights else 1)  # bytes a copy adds to a pass
    copies = max(1, -(-reuse // per_copy)) if per_copy and reuse > 0 else 1
    if copies > 1:
        copies = max(1, min(copies, int(COPY_MEMORY_SHARE * (memory or physical_memory())) // nbytes))
    sets = [args]
    if reuse > 0 and rot:  # every copy, the first included, on huge pages
        fresh = on_huge_pages([args[i] for i in rot], copies)
        sets = [[fresh[c * len(rot) + rot.index(i)] if i in rot else x for i, x in enumerate(args)] for c in range(copies)]
    if layered:
        if with_weights:
            order = [(i % len(sets), steps[i % len(steps)]) for i in range(max(len(sets), len(steps)))]
        else:  # a decode step per copy: its layers in order
            order = [(c, st) for c in range(len(sets)) for st in steps]
        sets = [[st.get(n, a) if n in STEP_SCALARS else a for n, a in zip(names, sets[c])] for c, st in order]
    return sets


def on_huge_pages(tensors: list, copies: int = 1) -> list:
    """`copies` copies of TVM tensors, one after another in one region of 2 MiB pages (copy c of tensor i at
    c * len(tensors) + i), as the engine holds the weights and the KV cache (4 KiB pages add a TLB miss every
    4 KiB of a stream, runtime/hugepages.py)."""
    import tvm

    from ..runtime.hugepages import huge_arrays

    data = [x.numpy() for x in tensors]
    arrays = huge_arrays([(a.shape, str(a.dtype)) for a in data] * copies)
    for i, a in enumerate(arrays):
        a[...] = data[i % len(data)]
    return [tvm.runtime.from_dlpack(a) for a in arrays]


def physical_memory() -> int:
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def time_passes(f, sets, calls: int, passes: int = 3) -> list[float]:
    """Seconds per call in each of `passes` timed passes of about `calls` calls, after one untimed pass."""
    for s in sets:
        f(*s)
    rounds = max(1, calls // len(sets))
    times = []
    for _ in range(passes):
        t = time.perf_counter()
        for _ in range(rounds):
            for s in sets:
                f(*s)
        times.append((time.perf_counter() - t) / (rounds * len(sets)))
    return times


def time_calls(f, sets, calls: int) -> float:
    """Median seconds per call over three timed passes of about `calls` calls each, after one untimed pass."""
    return statistics.median(time_passes(f, sets, calls))


def calls_for(req: KernelRequest, cold: bool) -> int:
    """Calls per timed pass: many for one-token kernels (microseconds each), few for chunks."""
    return 100 if cold else 3


def last_level_cache() -> int:
    from ..targets import detect_host

    return max(detect_host().caches.get("L3", 0), 32 << 20)


def timing_sets(func, req: KernelRequest, args, wl: Workload, cold: bool) -> list[list]:
    """The argument sets a kernel of `req` is timed with: `cold` (one-token kernels), its streamed buffers
    reread after the workload's step (reuse_bytes); else one set, hot. Its layers stepped through either way."""
    reuse = reuse_bytes(wl, last_level_cache()) if cold else 0
    return argument_sets(func, args, reuse, kv_steps(req, wl.layers), kv_read_bytes(req, wl))
