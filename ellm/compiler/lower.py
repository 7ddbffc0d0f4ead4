"""Lower the graph to one Relax module: per entry point, one VM function whose body is a call_tir per op."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import tvm
from tvm import relax, tirx

from ..quant import FORMATS
from ..quant.tiled import TILED_COMPONENTS
from ..schedules import KernelRequest, select_rule
from ..schedules.node_tasks import ATTR as NUMA_TASKS
from ..kv.plan import KVPlan
from ..targets import TargetPreset
from .graph import Graph, Op, OpKind, TensorType, WeightRef


@dataclass(frozen=True)
class Entry:
    """A VM function: `m` new tokens (None: any number) returning logits of all of them or of the last."""

    name: str
    m: int | None
    last_only: bool
    # rows computed as one-token steps would compute them (their activation precision, decode's attention),
    # so that a row's logits equal those of a decode step at its position bit for bit
    steps: bool = False


# The collectives a tensor-parallel rank's VM calls (registered by parallel/ccl.py before the VM loads).
CCL_ALLREDUCE = "ellm.ccl.allreduce"
CCL_ALLGATHER = "ellm.ccl.allgather"

# The most tokens a verification step takes: a drafted chain plus the token before it.
MAX_VERIFY = 32

ENTRIES: tuple[Entry, ...] = (
    Entry("prefill_all", None, False),  # teacher-forced logits
    Entry("prefill", None, True),  # prompt chunks
    Entry("decode", 1, True),  # one token
    Entry("verify", None, False, steps=True),  # a speculative chain (speculative/chain.py)
)


@dataclass(frozen=True)
class ParamSpec:
    """One tensor of the `params` tuple: a packed weight component or a float32 vector."""

    name: str  # "<weight>:<component>" or "<vector>"
    dtype: str
    shape: tuple[int, ...]
    sources: tuple[str, ...]  # GGUF tensors (row-)concatenated into it
    qtype: str | None  # weight format, None for vectors
    component: str | None
    layout: str | None = None  # "rows" | "tile16" for weights
    row_ids: tuple[int, ...] | None = None  # only these rows of the row-concatenated sources (WeightRef.row_ids)
    col_range: tuple[int, int] | None = None  # only these columns of every source (a row-parallel slice)
    values: tuple[int, ...] | None = None  # a constant the compiler computed (not from the GGUF)


@dataclass
class KernelInfo:
    name: str
    rule: str
    knobs: dict[str, int]
    request: dict[str, Any]
    req: KernelRequest  # the request itself (not serialised)
    # with a NUMA plan's tasks (`numa_tasks`): "planned" where the rule runs them, "static" where it keeps
    # TVM's static split; None without
    numa_tasks: str | None = None


@dataclass
class Lowered:
    mod: Any  # tvm.IRModule
    params: list[ParamSpec]
    kernels: list[KernelInfo] = field(default_factory=list)


KnobLookup = Callable[[KernelRequest, str], Mapping[str, int] | None]


def weight_components(w: WeightRef) -> list[tuple[str, str, tuple[int, ...]]]:
    """(component name, dtype, shape) of a weight in its layout, in kernel parameter order."""
    if w.layout == "tile16":
        return [(c.name, c.dtype, c.shape(w.rows, w.cols)) for c in TILED_COMPONENTS[w.qtype]]
    fmt = FORMATS[w.qtype]
    return [(c.name, c.dtype, fmt.component_shape(c, w.rows, w.cols)) for c in fmt.components]


def param_specs(g: Graph) -> list[ParamSpec]:
    specs: list[ParamSpec] = []
    seen: set[str] = set()
    for _, op in g.nodes():
        for w in op.weights:
            if w.name in seen:
                continue
            seen.add(w.name)
            for name, dtype, shape in weight_components(w):
                specs.append(ParamSpec(f"{w.name}:{name}", dtype, shape, w.sources, w.qtype.name, name, w.layout,
                                       w.row_ids, w.col_range))
        for _, v in op.vectors:
            if v.name not in seen:
                seen.add(v.name)
                specs.append(ParamSpec(v.name, v.dtype, (v.size,), v.sources, None, None, values=v.values))
    return specs


def kv_state_types(plan: KVPlan, NB) -> list[relax.TensorType]:
    """Relax types of the KV state tuple (kv/plan.py), with `NB` the symbolic number of blocks."""
    return [relax.TensorType([NB if d == "NB" else int(d) for d in s.shape], s.dtype) for s in plan.state_tensors()]


def _rtype(t: TensorType, T, C) -> relax.TensorType:
    dims = [T if d == "T" else C if d == "C" else int(d) for d in t.shape]
    return relax.TensorType(dims, t.dtype)


class _Lowering:
    def __init__(self, g: Graph, target: TargetPreset, knob_lookup: KnobLookup | None, max_chunk: int, prefetch: bool):
        self.g, self.target, self.knob_lookup = g, target, knob_lookup
        self.max_chunk = max_chunk
        self.prefetch = prefetch
        self.bb = relax.BlockBuilder()
        self.params = param_specs(g)
        self.param_index = {p.name: i for i, p in enumerate(self.params)}
        self.kernels: dict[tuple, tuple[Any, KernelInfo]] = {}
        self.plan = KVPlan.from_key(g.op("kv_cache").attr("kv_plan"))
        self.kv_index = {s.name: i for i, s in enumerate(self.plan.state_tensors())}

    # --- kernels --------------------------------------------------------------------------
    def kernel(self, req: KernelRequest, knob_req: KernelRequest | None = None):
        """`knob_req`: the request whose tuned knobs the kernel takes (default: its own)."""
        rule = select_rule(req, self.target)
        given = self.knob_lookup(knob_req or req, rule.name) if self.knob_lookup else None
        knobs = rule.resolve_knobs(req, self.target, given)
        key = (rule.name, req, tuple(sorted(knobs.items())))
        if key not in self.kernels:
            name = req.key()
            func = rule.build_kernel(req, self.target, knobs, prefetch=self.prefetch)
            func = func.with_attr("global_symbol", name)
            gv = self.bb.add_func(func, name)
            tasks = None if req.attr(NUMA_TASKS) is None else ("planned" if rule.follows_numa_tasks else "static")
            self.kernels[key] = (gv, KernelInfo(name, rule.name, knobs, req.describe(), req, tasks))
        return self.kernels[key][0]

    def request(self, op: Op, m: int | None, steps: bool = False, **extra_attrs) -> KernelRequest:
        """`steps`: rows of several tokens computed as one-token steps (Entry.steps)."""
        attrs = dict(op.attrs)
        attrs.update(extra_attrs)
        chunk_bits = attrs.pop("chunk_act_bits", None)
        if chunk_bits is not None and m is None and not steps:  # a chunk of tokens: the chunks' activation precision
            attrs["act_bits"] = chunk_bits
        if steps and m != 1 and op.kind is OpKind.ATTENTION:
            attrs["step_rows"] = 1
        w = op.weight
        if w is not None:
            attrs["layout"] = w.layout
        more = tuple((x.qtype, x.rows, x.cols, x.layout) for x in op.weights[1:])
        return KernelRequest(
            kind=op.kind,
            m=m,
            in_types=tuple(self.g.op(u.src).outs[u.index] for u in op.inputs),
            in_cols=tuple(u.cols for u in op.inputs),
            out_types=op.outs,
            qtype=w.qtype if w is not None else None,
            weight_shape=(w.rows, w.cols) if w is not None else None,
            vectors=tuple(r for r, _ in op.vectors),
            attrs=tuple(sorted(attrs.items())),
            more_weights=more,
        )

    # --- one entry point -------------------------------------------------------------------
    def function(self, entry: Entry) -> None:
        bb, g = self.bb, self.g
        T = tirx.Var("T", "int64") if entry.m is None else entry.m
        C = tirx.Var("C", "int64")
        tokens = relax.Var("tokens", relax.TensorType([T], "int32"))
        pos = relax.Var("pos", tvm.ir.PrimType("int64"))  # position of the first new token
        rope = relax.Var("rope", relax.TensorType([C, self._rope_dim()], "float32"))  # [ctx, cos | sin]
        self.kv_types = kv_state_types(self.plan, tirx.Var("NB", "int64"))
        kv = relax.Var("kv", relax.TupleType(self.kv_types))  # the KV state, written in place
        # kv/attention.py AttentionConfig.as_array: [n_layers, 5]
        self.attn = relax.Var("attn", relax.TensorType([self.plan.n_layers, 5], "float32"))
        params = relax.Var(
            "params", relax.TupleType([relax.TensorType(list(p.shape), p.dtype) for p in self.params])
        )
        # A bound on T lets the memory planner give every intermediate one fixed buffer, allocated once,
        # instead of a pooled allocation per distinct chunk length (which grows without limit).
        bound = MAX_VERIFY if entry.steps else self.max_chunk
        attrs = {"tir_var_upper_bound": {"T": bound}} if entry.m is None else {}
        # The parameters come last and are not checked on every call (VMShapeLower skips the arguments past
        # `num_input`): they are verified once at load, and every kernel checks its own arguments anyway.
        # At 423 parameters the checks were 1,300 VM instructions, a sixth of SmolLM2's decode step.
        attrs["num_input"] = 5
        with bb.function(entry.name, [tokens, pos, rope, kv, self.attn, params], attrs=attrs):
            with bb.dataflow():
                state = tuple(bb.emit(relax.TupleGetItem(kv, i)) for i in range(len(self.kv_types)))
                env: dict[tuple[str, int], Any] = {("tokens", 0): tokens, ("kv_cache", 0): state}
                getp = lambda name: bb.emit(relax.TupleGetItem(params, self.param_index[name]))  # noqa: E731
                for name, op in g.nodes():
                    if op.kind is OpKind.INPUT:
                        continue
                    last = entry.last_only and op.kind in (OpKind.LM_HEAD, OpKind.VOCAB_MERGE, OpKind.ALLGATHER)
                    m = 1 if last else entry.m
                    if op.kind in (OpKind.ALLREDUCE, OpKind.ALLGATHER):
                        env[(name, 0)] = self.emit_collective(op, env, T if m is None else m, C)
                        continue
                    # the head reads the last row of the chunk's hidden states; what follows it is already one row
                    head = last and op.kind is OpKind.LM_HEAD
                    req = self.request(op, m, last_row=True) if head else self.request(op, m, entry.steps)
                    # rows standing for one-token steps take the one-token kernel's knobs: split-K attention
                    # with other chunk sizes would merge its partial sums in another order
                    knob_req = self.request(op, 1) if entry.steps and op.kind is OpKind.ATTENTION else None
                    outs = self.emit(op, req, env, getp, T, C, pos, rope, knob_req)
                    for i, v in enumerate(outs):
                        env[(name, i)] = v
                (out,) = g.outputs
                logits = bb.emit_output(env[(out, 0)])
            bb.emit_func_output(logits)

    def _rope_dim(self) -> int:
        for _, op in self.g.nodes():
            if op.kind in (OpKind.ROPE, OpKind.ROPE_KV_APPEND, OpKind.ATTN_INPUT):
                return int(op.attr("rope_dim"))
        raise AssertionError("graph has no rope op")

    def emit(self, op: Op, req: KernelRequest, env, getp, T, C, pos, rope, knob_req=None) -> list:
        bb = self.bb
        gv = self.kernel(req, knob_req)
        ins = [env[(u.src, u.index)] for u in op.inputs]
        outs = [_rtype(t, T if req.m is None else req.m, C) for t in op.outs]
        weights = [getp(f"{w.name}:{name}") for w in op.weights for name, _, _ in weight_components(w)]
        vectors = [getp(v.name) for _, v in op.vectors]
        k = op.kind
        if k is OpKind.EMBEDDING:
            return [bb.emit(relax.call_tir(gv, [ins[0], *weights], outs[0]))]
        if k in (OpKind.MATMUL, OpKind.LM_HEAD, OpKind.FFN):
            # kernel params: x, [residual], *weight, [norm], [bias]
            args = [*ins, *weights, *vectors]
            return [bb.emit(relax.call_tir(gv, args, outs[0]))]
        if k in (OpKind.RMSNORM, OpKind.SILU_MUL, OpKind.ADD, OpKind.VOCAB_MERGE):
            return [bb.emit(relax.call_tir(gv, [*ins, *vectors], outs[0]))]
        if k is OpKind.ROPE:
            return [bb.emit(relax.call_tir(gv, [ins[0], rope, pos], outs[0]))]
        if k in (OpKind.KV_APPEND, OpKind.ROPE_KV_APPEND, OpKind.ATTN_INPUT, OpKind.ATTENTION):
            return self.emit_cache_op(op, gv, ins, weights, vectors, outs, pos, rope)
        raise AssertionError(f"cannot lower {k}")

    def emit_collective(self, op: Op, env, T, C):
        """A collective of the tensor-parallel ranks: a packed function of parallel/ccl.py, writing its output
        (destination-passing)."""
        (u,) = op.inputs
        out = _rtype(op.out, T, C)
        if op.kind is OpKind.ALLREDUCE:
            return self.bb.emit(relax.call_dps_packed(CCL_ALLREDUCE, [env[(u.src, u.index)]], out))
        widths = relax.ShapeExpr([int(w) for w in op.attr("widths")])
        return self.bb.emit(relax.call_dps_packed(CCL_ALLGATHER, [env[(u.src, u.index)], widths], out))

    def emit_cache_op(self, op: Op, gv, ins, weights, vectors, outs, pos, rope) -> list:
        """Kernels that read or write the KV state get this layer's ring and class stores, plus the layer
        and its K/V slots; writers update the state in place (call_tir_inplace)."""
        bb = self.bb
        idx, kslot, vslot = _cache_op_layout(self.plan, op.layer, self.kv_index)
        i64 = lambda v: relax.prim_value(tirx.IntImm("int64", v))  # noqa: E731
        where = [i64(op.layer), i64(kslot), i64(vslot)]
        k = op.kind
        if k is OpKind.ATTENTION:
            q, state = ins
            return [bb.emit(relax.call_tir(gv, [q, *[state[i] for i in idx], self.attn, pos, *where], outs[0]))]
        state = ins[0]
        kv_args = [state[i] for i in idx]
        kv_types = [self.kv_types[i] for i in idx]
        n = len(kv_args)
        if k is OpKind.KV_APPEND:
            _, k_in, v_in = ins
            res = bb.emit(relax.call_tir_inplace(gv, [*kv_args, k_in, v_in, pos, *where], list(range(n)), kv_types))
            q_out = None
        elif k is OpKind.ROPE_KV_APPEND:
            _, qkv = ins
            res = bb.emit(relax.call_tir_inplace(gv, [*kv_args, qkv, rope, pos, *where], [*range(n), -1], [*kv_types, outs[0]]))
            q_out = bb.emit(relax.TupleGetItem(res, n))
        else:  # ATTN_INPUT
            _, x = ins
            args = [*kv_args, x, *weights, *vectors, rope, pos, *where]
            res = bb.emit(relax.call_tir_inplace(gv, args, [*range(n), -1], [*kv_types, outs[0]]))
            q_out = bb.emit(relax.TupleGetItem(res, n))
        new_state = list(state)
        for j, i in enumerate(idx):
            new_state[i] = bb.emit(relax.TupleGetItem(res, j))
        return [tuple(new_state)] if q_out is None else [q_out, tuple(new_state)]


def _cache_op_layout(plan: KVPlan, layer: int, kv_index: dict[str, int]) -> tuple[list[int], int, int]:
    """(indices into the KV state of the buffers a kernel of this layer takes, K slot, V slot)."""
    kt, kslot = plan.slot("k", layer)
    vt, vslot = plan.slot("v", layer)
    return [kv_index[s.name] for s in plan.layer_tensors(kt, vt)], kslot, vslot


def lower(
    g: Graph,
    target: TargetPreset,
    knob_lookup: KnobLookup | None = None,
    entries=ENTRIES,
    max_chunk: int = 256,
    prefetch: bool = True,
) -> Lowered:
    """`max_chunk`: the most tokens one prefill step may take (the runtime splits longer prompts).
    `prefetch`: run the prefetch-injection pass on every kernel (else only drop its annotations)."""
    lw = _Lowering(g, target, knob_lookup, max_chunk, prefetch)
    for e in entries:
        lw.function(e)
    return Lowered(lw.bb.get(), lw.params, [info for _, info in lw.kernels.values()])
