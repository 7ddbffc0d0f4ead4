"""Row-wise kernels: embedding lookup (fused dequant), RMSNorm, SiLU*mul, add. Parallel over tokens, vectorised along rows."""

from __future__ import annotations

from typing import Mapping

import tvm
from tvm import te

from ..compiler.graph import OpKind
from ..quant import FORMATS
from ..targets import TargetPreset
from .dequant import dequant, dequant_tiled, split_k, split_row_loop, tiled_placeholders, weight_placeholders
from .matmul import token_dim
from .rule import KernelRequest, Rule
from .vecmath import sigmoid_f32


def _rowwise_schedule(func, block: str, lanes: int):
    """Parallel over the token loop, vectorise the (split) feature loop of `block`.

    These kernels have no knobs: LLVM already unrolls the short vector loop, so an unroll knob left
    the generated code unchanged (tests/test_schedule_knobs.py would flag it).
    """
    sch = tvm.s_tir.Schedule(func)
    loops = sch.get_loops(sch.get_sblock(block))
    sch.parallel(loops[0])
    _, v = sch.split(loops[-1], [None, lanes])
    sch.vectorize(v)
    return sch.mod["main"]


class EmbeddingRule(Rule):
    name = "embedding"

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return req.kind is OpKind.EMBEDDING

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        """`first_row` (a tensor-parallel rank's vocabulary slice, rows [first_row, first_row + vocab)): tokens
        outside the slice get zero rows, and the ranks' all-reduce assembles every token's row."""
        fmt = FORMATS[req.qtype]
        vocab, dim = req.weight_shape
        M = token_dim(req)
        tokens = te.placeholder((M,), "int32", name="tokens")
        first = req.attr("first_row")
        if first is None:
            row, keep = (lambda t: tokens[t]), None
        else:
            local = lambda t: tokens[t] - first  # noqa: E731
            row = lambda t: te.max(te.min(local(t), vocab - 1), 0)  # noqa: E731 (in bounds whether kept or not)
            keep = lambda t: tvm.tirx.all(local(t) >= 0, local(t) < vocab)  # noqa: E731
        tiled = req.attr("layout") == "tile16"  # tied with an LM head in 16-row tiles: gather the row's lanes
        w = tiled_placeholders(req.qtype, vocab, dim) if tiled else weight_placeholders(fmt, vocab, dim)

        def value(t, c):
            v = dequant_tiled(req.qtype, w, row(t), c) if tiled else dequant(fmt, w, row(t), *split_k(fmt, c))
            return v if keep is None else tvm.tirx.if_then_else(keep(t), v, tvm.tirx.const(0.0, "float32"))

        out = te.compute((M, dim), value, name="embed")
        sch = tvm.s_tir.Schedule(te.create_prim_func([tokens, *w.values(), out]))
        block = sch.get_sblock("embed")
        sch.parallel(sch.get_loops(block)[0])
        if not tiled:
            split_row_loop(sch, block, fmt)
        return sch.mod["main"]


class RmsNormRule(Rule):
    name = "rmsnorm"

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return req.kind is OpKind.RMSNORM and req.in_cols[0] is None

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        M, K = token_dim(req), req.in_types[0].width
        eps = float(req.attr("eps"))
        x = te.placeholder((M, K), "float32", name="x")
        g = te.placeholder((K,), "float32", name="norm")
        k = te.reduce_axis((0, K), "k")
        ss = te.compute((M,), lambda t: te.sum(x[t, k] * x[t, k], axis=k), name="sumsq")
        rstd = te.compute((M,), lambda t: 1.0 / te.sqrt(ss[t] / float(K) + eps), name="rstd")
        out = te.compute((M, K), lambda t, c: x[t, c] * rstd[t] * g[c], name="out")
        func = _rowwise_schedule(te.create_prim_func([x, g, out]), "out", target.f32_lanes)
        sch = tvm.s_tir.Schedule(func)
        t = sch.get_loops(sch.get_sblock("out"))[0]
        sch.compute_at(sch.get_sblock("rstd"), t)
        sch.compute_at(sch.get_sblock("sumsq"), t)
        return sch.mod["main"]


def _cols(req: KernelRequest, i: int) -> int:
    c = req.in_cols[i]
    return c[0] if c else 0


class SiluMulRule(Rule):
    name = "silu_mul"

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return req.kind is OpKind.SILU_MUL

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        M, F = token_dim(req), req.out_types[0].width
        g = te.placeholder((M, req.in_types[0].width), "float32", name="gate")
        u = te.placeholder((M, req.in_types[1].width), "float32", name="up")
        g0, u0 = _cols(req, 0), _cols(req, 1)

        def silu_mul(t, c):
            a = g[t, g0 + c]
            return a * sigmoid_f32(a) * u[t, u0 + c]

        out = te.compute((M, F), silu_mul, name="out")
        return _rowwise_schedule(te.create_prim_func([g, u, out]), "out", target.f32_lanes)


class AddRule(Rule):
    name = "add"

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return req.kind is OpKind.ADD and req.in_cols == (None, None)

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        M, D = token_dim(req), req.out_types[0].width
        a = te.placeholder((M, D), "float32", name="a")
        b = te.placeholder((M, D), "float32", name="b")
        out = te.compute((M, D), lambda t, c: a[t, c] + b[t, c], name="out")
        return _rowwise_schedule(te.create_prim_func([a, b, out]), "out", target.f32_lanes)


class VocabMergeRule(Rule):
    """out[t, i] = the logit of token i from the head's row set that holds it: `index[i]` is its position in
    the concatenation hot ++ cold. Parallel over chunks of the vocabulary (a decode step has one token)."""

    name = "vocab_merge"
    CHUNK = 4096  # vocabulary entries per parallel task: a gather, cheap per entry

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return req.kind is OpKind.VOCAB_MERGE

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        M, V = token_dim(req), req.out_types[0].width
        H, C = req.in_types[0].width, req.in_types[1].width
        hot = te.placeholder((M, H), "float32", name="hot")
        cold = te.placeholder((M, C), "float32", name="cold")
        index = te.placeholder((V,), "int32", name="index")

        def merge(t, i):
            j = index[i]
            return tvm.tirx.if_then_else(j < H, hot[t, tvm.tirx.min(j, H - 1)], cold[t, tvm.tirx.max(j - H, 0)])

        out = te.compute((M, V), merge, name="out")
        sch = tvm.s_tir.Schedule(te.create_prim_func([hot, cold, index, out]))
        t, i = sch.get_loops(sch.get_sblock("out"))
        outer, _ = sch.split(i, [None, self.CHUNK])
        sch.reorder(outer, t)
        sch.parallel(outer)
        return sch.mod["main"]
