"""Causal GQA attention over the block KV cache (kv/plan.py), a block of B keys at a time.

Keys are stored transposed ([hd, 16] per tile), so the scores of 16 keys are one vector: sum over d of
q[d] * K[d, 16 keys], no horizontal sums. Quantised keys (per channel: min, scale) score as
sum_d q_d min_d + sum_d (q_d scale_d) code_d; quantised values (per token: min, scale) accumulate as
sum_j p_j min_j + sum_j (p_j scale_j) code_j. One task serves all G query heads of a KV head (each K and V
vector is loaded and converted once for G heads), with one online-softmax update per block. With VNNI,
both sums over codes run in int32 with vpdpbusd: the query times the key scales, and the weights
p_j scale_j, rounded to 16 bits per block (two int8 halves), against codes laid out 4 channels (keys) or
4 keys (values) per 32-bit lane. Single-token decode splits the blocks into chunks across threads
(split-K), prefetching the stored block ahead, and merges the partial softmax states; a verification step
runs that per row, so its rows equal decode steps bit for bit. Query t of a step
sits at position pos + t and sees positions 0 .. pos + t; it reads block b from the float16 ring when
b > (pos + t) // B - recent, else from the store.
"""

from __future__ import annotations

import math
from typing import Mapping

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script.builder import ir as I

from ..compiler.graph import OpKind
from ..kv.plan import KVPlan, KVType
from ..targets import TargetPreset
from .attention_block import Query, State, attend, finish
from .intdot import Dot, dot_for
from .kv_blocks import KVBuffers, L, bc, ramp
from .node_tasks import NodeTasks
from .read_list import ReadShape, list_item, n_items, opaque, select_blocks, widen
from .rule import KernelRequest, Knob, Rule
from .vecmath import exp_f32


def kv_plan_of(req: KernelRequest) -> tuple[KVPlan, KVType, KVType]:
    """The request's KV plan and this layer's K and V types (attrs set by lowering)."""
    plan = KVPlan.from_key(req.attr("kv_plan"))
    return plan, KVType(req.attr("kv_k")), KVType(req.attr("kv_v"))


def build_attention(req: KernelRequest, chunk: int, dot: Dot | None = None, int_scores: bool = False,
                    int_values: bool = False, prefetch: int = 0, int_bits: int = 16, prefetch_locality: int = 2,
                    chunk_major: bool = False):
    """`chunk` > 0 splits the keys of single-token steps into chunks of that many keys (whole blocks).
    With `dot` (the target's integer dot products): `int_scores`, quantised key blocks are scored in int32
    against the query rounded to `int_bits` bits (16 or 8); `int_values`, quantised value blocks are summed
    in int32, the weights rounded to `int_bits` bits. `prefetch` > 0: decode prefetches the stored block
    that many items ahead in its read list, with LLVM locality `prefetch_locality`. Decode's split-K tasks
    run head-major (a thread's share of tasks: consecutive chunks of one KV head) or, `chunk_major`, the
    KV heads of one chunk side by side."""
    plan, kt, vt = kv_plan_of(req)
    hd, Hkv = plan.head_dim, plan.n_kv_heads
    H = int(req.attr("n_heads"))
    G = H // Hkv
    scale = 1.0 / math.sqrt(hd)
    with IRBuilder() as ib:
        with I.prim_func():
            I.func_name("attention")
            I.func_attr({"tirx.noalias": True})
            n = req.m if req.m is not None else tirx.Var("T", "int64")
            q = I.arg("q", I.buffer((n, H * hd), "float32"))  # [T, n_heads * head_dim], rotated
            kv = KVBuffers.declare(plan, kt, vt, dot, int_scores, int_values, int_bits)
            # [n_layers, 5]: per layer sinks, window, topk, widen, margin (kv/attention.py)
            attn = I.arg("attn", I.buffer((plan.n_layers, 5), "float32"))
            pos, layer, kslot, vslot = KVBuffers.step_args()
            out = I.arg("out", I.buffer((n, H * hd), "float32"))
            ctx = (q, kv, attn, pos, layer, kslot, vslot, out, Hkv, G, hd, scale)
            if chunk and step_rows(req):
                _decode(*ctx, max(1, chunk // plan.block), prefetch, prefetch_locality, chunk_major, n, NodeTasks.of(req))
            else:
                _prefill(*ctx, n, NodeTasks.of(req))
    return ib.get()


def _prefill(q, kv, attn, pos, layer, kslot, vslot, out, Hkv: int, G: int, hd: int, scale: float, n,
             nodes: NodeTasks | None = None) -> None:
    """Tasks = (query row, KV head), rows in zig-zag order (0, last, 1, last-1, ...) so each thread's
    contiguous share of tasks mixes short and long causal rows. Each row selects its own blocks exactly
    as a decode step at its position would. `nodes`: a NUMA plan's KV heads per node, whose threads share
    out the tasks of those heads."""
    NBp = kv.nb + L
    bounds = I.alloc_buffer((n * Hkv * NBp,), "float32")
    sel = I.alloc_buffer((n * Hkv * kv.nb,), "int32")

    def row_task(task):
        r = task // Hkv
        kvh = task % Hkv
        t = I.Bind(tirx.Select(r % 2 == 0, r // 2, n - 1 - r // 2))
        sh = ReadShape(kv, attn, layer, pos + t + 1)
        qy = Query(q, t, kvh * G, G, hd, scale, kv.query_bits, kv.rotated)
        states = [State(hd, kv.block, kv.int_bits) for _ in range(G)]
        count = I.alloc_buffer((1,), "int32")
        thr = I.alloc_buffer((1,), "float32")
        I.buffer_store(count, tirx.const(0, "int32"), [0])
        sbase = task * kv.nb
        with I.If(sh.dense == 0):
            with I.Then():
                t_ = select_blocks(kv, qy, G, kvh, kslot, sh, bounds, task * NBp, sel, sbase, count)
                I.buffer_store(thr, t_[0], [0])
        cnt = I.Bind(tirx.Cast("int64", count[0]))
        with I.serial(0, I.Bind(opaque(n_items(sh, cnt)))) as i:
            b = I.Bind(list_item(sh, i, cnt, lambda j: sel[sbase + j]))
            attend(kv, qy, layer, kslot, vslot, kvh, b, sh.n_ctx, sh.first_ring, states)
        with I.If(sh.dense == 0):
            with I.Then():
                last = tirx.Select(cnt > 0, sel[sbase + tirx.max(cnt - 1, 0)], -1)
                widen(kv, qy, layer, kslot, vslot, kvh, sh, bounds, task * NBp, thr, last, states, sel, sbase, cnt)
        finish(out, t, kvh, G, hd, states)

    if nodes is None:
        with I.parallel(0, n * Hkv) as task:
            row_task(task)
    else:  # a node's KV heads, each with its rows in zig-zag order, shared out among its threads
        def planned(task, ranges):
            (lo, hi), = ranges
            with I.serial(lo, hi) as u:
                row_task(u % n * Hkv + u // n)

        nodes.loop(planned, "int64", scale=n)


def _per_row(nodes: NodeTasks | None, n, Hkv: int, body) -> None:
    """body(row) for rows (t, KV head) = t * Hkv + kvh in parallel: TVM's static split, or with a NUMA plan
    each node's threads the rows of its KV heads (head-major, shared out among them)."""
    if nodes is None:
        with I.parallel(0, n * Hkv) as row:
            body(row)
        return

    def planned(task, ranges):
        (lo, hi), = ranges
        with I.serial(lo, hi) as u:
            body(u % n * Hkv + u // n)

    nodes.loop(planned, "int32" if isinstance(n, int) else "int64", scale=None if isinstance(n, int) and n == 1 else n)


def _decode(q, kv, attn, pos, layer, kslot, vslot, out, Hkv: int, G: int, hd: int, scale: float, bpc: int,
            prefetch: int, locality: int = 2, chunk_major: bool = False, n=1, nodes: NodeTasks | None = None) -> None:
    """Query rows as one-token steps: row t (at position pos + t) is computed exactly as a decode step at
    that position would compute it, the same work in the same order, so a verification step's rows equal
    the decode steps they stand for bit for bit (one row: a decode step).
    Phase 1 (sparse only, one task per row and KV head): bounds, top-K and the block list.
    Phase 2: tasks = (row, KV head, run of bpc blocks of the row's list) write partial (max, sum, acc) (split-K).
    Phase 3, per row and KV head: merge the partials of its G query heads in run order, widen if needed,
    normalise.
    `nodes`: a NUMA plan's KV heads per node, whose threads run only the tasks of those heads
    (schedules/node_tasks.py)."""
    NBp = kv.nb + L
    zero = tirx.IntImm("int64", 0)
    bounds = I.alloc_buffer((n * Hkv * NBp,), "float32")
    sel = I.alloc_buffer((n * Hkv * kv.nb,), "int32")
    n_list = I.alloc_buffer((n * Hkv,), "int32")
    thrs = I.alloc_buffer((n * Hkv,), "float32")
    lasts = I.alloc_buffer((n * Hkv,), "int32")

    def shape(t) -> ReadShape:
        return ReadShape(kv, attn, layer, pos + t + 1)

    def runs(sh: ReadShape):
        # items: dense, blocks 0 .. cur; sparse, per KV head: the sinks, the selected blocks, the window
        listed = n_items(sh, tirx.Select(sh.dense == 1, zero, sh.topk))
        return (listed + bpc - 1) // bpc

    def choose_blocks(task):
        t, kvh = task // Hkv, task % Hkv
        sh = shape(t)
        with I.If(sh.dense == 0):
            with I.Then():
                qy = Query(q, t, kvh * G, G, hd, scale, rotate=kv.rotated)
                count = I.alloc_buffer((1,), "int32")
                thr = select_blocks(kv, qy, G, kvh, kslot, sh, bounds, task * NBp, sel, task * kv.nb, count)
                I.buffer_store(thrs, thr[0], [task])
                I.buffer_store(lasts, tirx.Select(count[0] > 0, sel[task * kv.nb + tirx.max(count[0] - 1, 0)], -1), [task])
                I.buffer_store(n_list, count[0], [task])

    _per_row(nodes, n, Hkv, choose_blocks)
    if isinstance(n, int) and n == 1:
        n_runs = I.Bind(runs(shape(0)))
    else:  # the most runs of any row; a row's tasks past its own runs are empty
        most = I.alloc_buffer((1,), "int64")
        I.buffer_store(most, zero, [0])
        with I.serial(0, n) as t:
            I.buffer_store(most, tirx.max(most[0], runs(shape(t))), [0])
        n_runs = I.Bind(opaque(most[0]))
    # sized from NB alone (the list never exceeds NB blocks): TVM's storage rewrite hoists allocations
    # to the top of the function, above any value computed at run time
    max_runs = (kv.nb + bpc - 1) // bpc
    part_st = I.alloc_buffer((n * Hkv * max_runs * G * 2,), "float32")
    part_acc = I.alloc_buffer((n * Hkv * max_runs * G * hd,), "float32")

    def split_k(job):
        # rows innermost: the tasks of one run of several rows read (mostly) the same blocks one after another
        t, rest = job % n, job // n
        kvh = rest % Hkv if chunk_major else rest // n_runs
        c = rest // Hkv if chunk_major else rest % n_runs
        row = t * Hkv + kvh
        task = row * n_runs + c  # where its partial state goes, whatever the order tasks run in
        sh = shape(t)
        qy = Query(q, t, kvh * G, G, hd, scale, kv.query_bits, kv.rotated)
        states = [State(hd, kv.block, kv.int_bits) for _ in range(G)]
        cnt = I.Bind(opaque(tirx.Select(sh.dense == 1, zero, tirx.Cast("int64", n_list[row]))))
        end = I.Bind(opaque(n_items(sh, cnt)))
        with I.serial(c * bpc, tirx.min(c * bpc + bpc, end)) as i:
            if prefetch:  # the list's block `prefetch` items ahead (past this task's run too: the same thread
                # usually takes the next run)
                with I.If(i + prefetch < end):
                    with I.Then():
                        ahead = I.Bind(list_item(sh, i + prefetch, cnt, lambda j: sel[row * kv.nb + j]))
                        kv.prefetch_block(kslot, vslot, kvh, ahead, locality)
            b = I.Bind(list_item(sh, i, cnt, lambda j: sel[row * kv.nb + j]))
            attend(kv, qy, layer, kslot, vslot, kvh, b, sh.n_ctx, sh.first_ring, states)
        for g, st in enumerate(states):
            st.fold()
            I.buffer_store(part_st, st.m[0], [(task * G + g) * 2])
            I.buffer_store(part_st, st.l[0], [(task * G + g) * 2 + 1])
            for cc in range(hd // L):
                I.buffer_store(part_acc, st.acc[ramp(cc * L)], [ramp((task * G + g) * hd + cc * L)])

    if nodes is None:
        with I.parallel(0, n * Hkv * n_runs) as job:
            split_k(job)
    else:  # a node's jobs (head-major: its KV heads' runs of all rows), shared by its threads
        def planned(task, ranges):
            (lo, hi), = ranges
            with I.serial(lo, hi) as job:
                split_k(job)

        nodes.loop(planned, "int64", scale=n_runs * n)

    def merge(row):
        t, kvh = row // Hkv, row % Hkv
        sh = shape(t)
        own = I.Bind(runs(sh))
        states = [State(hd, kv.block, kv.int_bits) for _ in range(G)]
        for g, st in enumerate(states):
            with I.serial(0, own) as c:
                I.buffer_store(st.m, tirx.max(st.m[0], part_st[((row * n_runs + c) * G + g) * 2]), [0])
            with I.serial(0, own) as c:
                base = (row * n_runs + c) * G + g
                w = I.Bind(exp_f32(part_st[base * 2] - st.m[0]))
                I.buffer_store(st.l, st.l[0] + part_st[base * 2 + 1] * w, [0])
                for cc in range(hd // L):
                    I.buffer_store(st.acc, st.acc[ramp(cc * L)] + part_acc[ramp(base * hd + cc * L)] * bc(w), [ramp(cc * L)])
        with I.If(sh.dense == 0):
            with I.Then():
                qy = Query(q, t, kvh * G, G, hd, scale, kv.query_bits, kv.rotated)
                thr = I.alloc_buffer((1,), "float32")
                I.buffer_store(thr, thrs[row], [0])
                widen(kv, qy, layer, kslot, vslot, kvh, sh, bounds, row * NBp, thr, lasts[row], states, sel, row * kv.nb,
                      tirx.Cast("int64", n_list[row]), prefetch > 0, locality)
        finish(out, t, kvh, G, hd, states)

    _per_row(nodes, n, Hkv, merge)


def _applies(req: KernelRequest) -> bool:
    return req.kind is OpKind.ATTENTION and req.in_cols[0] is None and req.attr("kv_plan") is not None


INT_BITS = Knob("int_bits", 16, (8, 16), "bits the query and the value weights are rounded to for integer dot products",
               numerics=True)


def default_int_bits(target: TargetPreset) -> int:
    """For requests that do not say, and compiled models with `--activations auto` (the plan_kv_cache pass):
    16 where dot products are 512 bits wide; 8 with 256-bit ones, where attention at long context is
    compute-bound and 16-bit factors (two int8 halves) double its dot products."""
    dot = dot_for(target)
    return 16 if dot is None or dot.width == 512 else 8


class _AttentionRule(Rule):
    def default_knobs(self, req: KernelRequest, target: TargetPreset) -> dict[str, int]:
        knobs = super().default_knobs(req, target)
        knobs["int_bits"] = int(req.attr("int_bits", default_int_bits(target)))
        return knobs


def step_rows(req: KernelRequest) -> bool:
    """Whether the request's rows must each equal a one-token step (a verification step's attention)."""
    return req.m == 1 or bool(req.attr("step_rows"))


class AttentionDecodeRule(_AttentionRule):
    """One token, or rows that must equal one-token steps: split-K over (row, KV head, key chunk) tasks,
    then a merge per row in chunk order."""

    name = "attention_decode"
    follows_numa_tasks = True
    knobs = (
        Knob("chunk_blocks", 4, (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64), "KV blocks per split-K task"),
        Knob("chunk_major", 0, (0, 1), "split-K tasks in order of KV head (0) or of chunk (1)"),
        Knob("int_scores", 1, (0, 1), "score quantised key blocks with integer dot products", numerics=True),
        Knob("int_values", 1, (0, 1), "sum quantised value blocks with integer dot products", numerics=True),
        Knob("prefetch", 1, (0, 1, 2, 3, 4, 5, 6), "prefetch the stored block this many items ahead in the read list (0: off)"),
        Knob("prefetch_locality", 2, (0, 1, 2, 3), "prefetch kind: LLVM locality 0 (prefetchnta) .. 3 (prefetcht0)"),
        INT_BITS,
    )

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return step_rows(req) and _applies(req)

    def canonical(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]) -> dict[str, int]:
        out = dict(knobs)
        if out.get("prefetch") == 0:  # nothing prefetched: the kind is moot
            out["prefetch_locality"] = 2
        # one KV head: both orders are the same; a NUMA plan's tasks run their node's heads head-major
        if Hkv_of(req) == 1 or NodeTasks.of(req) is not None:
            out["chunk_major"] = 0
        return out

    def default_knobs(self, req: KernelRequest, target: TargetPreset) -> dict[str, int]:
        knobs = super().default_knobs(req, target)
        knobs["chunk_blocks"] = max(1, 256 // kv_plan_of(req)[0].block)  # 256 keys a task
        return knobs

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        return build_attention(req, knobs["chunk_blocks"] * kv_plan_of(req)[0].block, dot_for(target), bool(knobs["int_scores"]), bool(knobs["int_values"]),
                               knobs["prefetch"], knobs["int_bits"], knobs["prefetch_locality"], bool(knobs["chunk_major"]))


def Hkv_of(req: KernelRequest) -> int:
    return kv_plan_of(req)[0].n_kv_heads


class AttentionPrefillRule(_AttentionRule):
    """A chunk of tokens: tasks over (query row, KV head), causal."""

    name = "attention"
    knobs = (INT_BITS,)
    follows_numa_tasks = True

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return not step_rows(req) and _applies(req)

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        return build_attention(req, 0, dot_for(target), True, True, int_bits=knobs["int_bits"])
