"""Choose each weight's memory layout for its kernel and target: 16-row tiles feed integer dot products."""

from __future__ import annotations

from dataclasses import replace

from ...quant import QuantType
from ...quant.tiled import tiled_supported
from ..graph import Graph, OpKind
from ..pass_context import PassContext

# Formats the integer kernels (schedules/int_kernel.py) read in the tile16 layout.
INT_FORMATS = (QuantType.Q4_0, QuantType.Q4_1, QuantType.Q8_0, QuantType.Q4_K, QuantType.Q6_K)


def choose_weight_layout(g: Graph, ctx: PassContext) -> Graph:
    """tile16 for quantised matmul weights on targets with integer dot products (AVX2 and later) and integer
    activations; GGUF rows otherwise.

    Matmuls on tile16 weights get the activation width of one-token steps (`act_bits`) and of multi-token
    chunks (`chunk_act_bits`; lowering gives each kernel its own as `act_bits`). A weight shared by the LM head and
    the embedding (tied) follows the head: the embedding kernel reads either layout.
    """
    g = g.copy()
    use_tiles = ctx.target.isa is not None and ctx.integer
    chosen: dict[str, str] = {}
    for name in g.names():
        op = g.op(name)
        if op.kind not in (OpKind.MATMUL, OpKind.LM_HEAD):
            continue
        for w in op.weights:
            tiled = use_tiles and w.qtype in INT_FORMATS and tiled_supported(w.qtype, w.rows, w.cols)
            chosen[w.name] = "tile16" if tiled else "rows"
    bits = {"int16": 16, "int8": 8, "f32": 0}
    step_bits, chunk_bits = bits[ctx.activations], bits[ctx.chunk_activations]
    for name in g.names():
        op = g.op(name)
        if not any(w.name in chosen for w in op.weights):
            continue
        weights = tuple(replace(w, layout=chosen.get(w.name, w.layout)) for w in op.weights)
        new = replace(op, weights=weights)
        if any(w.layout == "tile16" for w in weights) and op.kind is not OpKind.EMBEDDING:
            new = new.with_attrs(act_bits=step_bits, chunk_act_bits=chunk_bits)
        g.set_op(name, new)
    return g
