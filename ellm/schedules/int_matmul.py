"""Integer matmuls: activations quantised in the kernel times packed low-bit tile16 weights, summed exactly
in int32 by the target's dot-product class (schedules/intdot.py), one rule per class.

Phase 1 quantises each token's row (with the RMSNorm prologue fused, schedules/int_acts.py); phase 2
runs row tiles in parallel through the micro-kernel (schedules/int_kernel.py), every task's weights
streamed once (prefetched ahead) and reused from L1 by all tokens of a tile of tokens.
"""

from __future__ import annotations

from typing import ClassVar, Mapping

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script.builder import ir as I

from ..compiler.graph import OpKind
from ..quant.tiled import TILED_COMPONENTS
from ..targets import IsaClass, TargetPreset, dot_class
from .int_acts import L, Acts, quantize_row
from .int_kernel import (PREFETCH_LOCALITY, QUANTIZED, Rows, default_locality, for_token_tiles, group_size, micro_kernel,
                         store_epilogue, without_moot_locality)
from .intdot import Dot, dot_for
from .node_tasks import NodeTasks
from .rule import KernelRequest, Knob, Rule
from .space import Constraint, divides


def build_int_matmul(req: KernelRequest, dot: Dot, tokens_per_tile: int, tiles_per_task: int, prefetch_bytes: int,
                     prefetch_locality: int, lanes: int = L, group_unroll: int = 1, strided: bool = False):
    """The PrimFunc (x, [residual], *weights, [norm], [bias], out) for a tile16 weight.

    `req.attr("act_bits")` is 8 (one dot product per weight vector and token) or 16 (two: high and low byte).
    `lanes`: rows per accumulator: 16, or 8 (half tiles, in two passes over the inputs: one ymm register each).
    A task takes `tiles_per_task` row tiles (which must divide N / 16): adjacent ones (one contiguous weight
    stream), or with `strided` tiles N / 16 / tiles_per_task apart (that many streams).
    """
    bits = int(req.attr("act_bits", 8))
    qtype = req.qtype
    N, K = req.weight_shape
    NT = N // L
    tpt = tiles_per_task
    assert NT % tpt == 0, (NT, tpt)
    eps = float(req.attr("norm_eps", 0.0))
    last_row = bool(req.attr("last_row"))
    has_res, has_norm, has_bias = bool(req.attr("residual")), "norm" in req.vectors, "bias" in req.vectors

    with IRBuilder() as ib:
        with I.prim_func():
            I.func_name("int_matmul")
            I.func_attr({"tirx.noalias": True})
            n_tok = req.m if req.m is not None else tirx.Var("T", "int64")
            rows_in = tirx.Var("T", "int64") if last_row else n_tok
            x = I.arg("x", I.buffer((rows_in, K), "float32"))  # [T, K]
            res = I.arg("residual", I.buffer((n_tok, N), "float32")) if has_res else None
            w = {c.name: I.arg(f"w_{c.name}", I.buffer(c.shape(N, K), c.dtype)) for c in TILED_COMPONENTS[qtype]}
            gain = I.arg("norm", I.buffer((K,), "float32")) if has_norm else None
            bias = I.arg("bias", I.buffer((N,), "float32")) if has_bias else None
            out = I.arg("out", I.buffer((n_tok, N), "float32"))  # [T, N]
            acts = Acts.alloc(n_tok, K, bits)

            # --- phase 1: (RMSNorm and) quantisation of each token's row ----------------------------
            with (I.serial if req.m == 1 else I.parallel)(0, n_tok) as t:
                quantize_row(x, (rows_in - 1) if last_row else t, gain, eps, K, acts, t)

            # --- phase 2: row tiles in parallel, all tokens of a task reuse its weights from L1 ------
            store = store_epilogue(out, res, bias)

            def run(tiles):
                # half tiles (lanes = 8) run one after the other: each pass holds half the accumulators
                for first in range(0, L, lanes):
                    slots = [Rows(t, first, lanes) for t in tiles]
                    for_token_tiles(
                        req.m, n_tok, tokens_per_tile,
                        lambda t0, tt, slots=slots: micro_kernel(dot, qtype, w, slots, t0, tt, K, acts, store,
                                                                 prefetch_bytes, prefetch_locality,
                                                                 group_unroll=group_unroll),
                    )

            nodes = NodeTasks.of(req)
            if nodes is None:
                with I.parallel(0, NT // tpt) as task:
                    run([task + j * (NT // tpt) if strided else task * tpt + j for j in range(tpt)])
            else:  # the NUMA plan's tasks: each thread its share of its node's tiles, `tpt` adjacent at a time
                nodes.loop(lambda task, ranges: _planned_tiles(ranges, tpt, run), "int32")
    return ib.get()


def _planned_tiles(ranges, tpt: int, run) -> None:
    """run(tiles) over the tiles of `ranges` ([(lo, hi)] PrimExprs): groups of `tpt`, then single tiles."""
    for lo, hi in ranges:
        groups = (hi - lo) // tpt
        with I.serial(0, groups) as g:
            run([lo + g * tpt + j for j in range(tpt)])
        if tpt > 1:
            with I.serial(lo + groups * tpt, hi) as tile:
                run([tile])


def int_matmul_applies(req: KernelRequest) -> bool:
    return (
        req.kind in (OpKind.MATMUL, OpKind.LM_HEAD)
        and req.qtype in QUANTIZED
        and req.attr("layout") == "tile16"
        and req.in_cols[0] is None
    )


PREFIX = {IsaClass.AVX512_VNNI: "vnni", IsaClass.AVX_VNNI: "avxvnni", IsaClass.AVX2: "avx2"}


class _IntRule(Rule):
    """A rule for one dot-product class: applies where that is the target's class for vector dot products."""

    kind: ClassVar[str]

    def __init__(self, isa: IsaClass):
        self.isa = isa
        self.name = f"{PREFIX[isa]}_{self.kind}"

    def isa_applies(self, target: TargetPreset) -> bool:
        return target.isa is not None and dot_class(target.isa) is self.isa

    def dot(self, target: TargetPreset) -> Dot:
        d = dot_for(target)
        assert d is not None and d.isa is self.isa
        return d


def accumulator_registers(target: TargetPreset, tokens: int, tiles: int, lanes: int, bits: int) -> int:
    """Vector registers a micro-kernel's accumulators hold: per token and slot a float32 sum and an int32 sum
    per activation byte, each of `lanes` int32 (two registers where 16 lanes exceed a 256-bit register)."""
    per = max(1, lanes * 32 // target.vector_bits)
    return tokens * tiles * per * (1 + (2 if bits == 16 else 1))


def vector_registers(target: TargetPreset) -> int:
    return 32 if target.has("avx512f") else 16


# operands, broadcast factors and constants the micro-kernel keeps live beside its accumulators
SCRATCH_REGISTERS = 4

TILES_PER_TASK = Knob("tiles_per_task", 1, (1, 2, 3, 4, 6, 8), "row tiles of 16 a task accumulates together")
TASK_ORDER = Knob("strided_tiles", 0, (0, 1), "a task's row tiles adjacent (0: one weight stream) or spread (1)")
LANES = Knob("lanes", 16, (8, 16), "rows per accumulator: whole tiles (16) or half tiles (8, one ymm register)")
GROUP_UNROLL = Knob("group_unroll", 1, (1, 2, 3, 4), "groups of inputs per iteration of the reduction loop")


class _TiledRule(_IntRule):
    """What the one-token and the chunk rules share: the tiling constraints, the prefetch kind's default."""

    follows_numa_tasks = True

    def default_knobs(self, req: KernelRequest, target: TargetPreset) -> dict[str, int]:
        knobs = super().default_knobs(req, target)
        knobs["prefetch_locality"] = default_locality(target)
        return knobs

    def canonical(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]) -> dict[str, int]:
        out = without_moot_locality(knobs, target)
        # one tile per task, or one task for all tiles: adjacent and spread are the same
        # the NUMA plan's tasks take their node's tiles adjacent (schedules/node_tasks.py)
        if out.get("tiles_per_task") in (1, req.weight_shape[0] // L) or NodeTasks.of(req) is not None:
            out["strided_tiles"] = 0
        return out

    def constraints(self, req: KernelRequest, target: TargetPreset) -> tuple[Constraint, ...]:
        N, K = req.weight_shape
        bits = int(req.attr("act_bits", 8))
        budget = vector_registers(target) - SCRATCH_REGISTERS
        tokens = lambda p: p.get("tokens_per_tile", 1) if req.m != 1 else 1  # noqa: E731
        return (
            divides("tiles_per_task", N // L, "row tiles"),
            divides("group_unroll", K // group_size(req.qtype), "groups of inputs"),
            Constraint(f"accumulators fit in {budget} vector registers (more spill to the stack every group)",
                       lambda p: accumulator_registers(target, tokens(p), p["tiles_per_task"], p["lanes"], bits) <= budget),
        )

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        tokens = knobs.get("tokens_per_tile", 1) if req.m != 1 else 1
        return build_int_matmul(req, self.dot(target), tokens, knobs["tiles_per_task"], knobs["prefetch_bytes"],
                                knobs["prefetch_locality"], knobs["lanes"], knobs["group_unroll"],
                                bool(knobs["strided_tiles"]))


class IntGemvRule(_TiledRule):
    """One token: phase 1 quantises x, phase 2 streams every weight once (prefetched ahead)."""

    kind = "gemv"
    knobs = (
        TILES_PER_TASK,
        TASK_ORDER,
        LANES,
        GROUP_UNROLL,
        Knob("prefetch_bytes", 4096, (0, 512, 1024, 2048, 3072, 4096, 6144, 8192, 12288, 16384),
             "software prefetch distance in the weight stream"),
        PREFETCH_LOCALITY,
    )

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return req.m == 1 and self.isa_applies(target) and int_matmul_applies(req)


class IntGemmRule(_TiledRule):
    """A chunk of tokens: a task's weights stay in L1 while its tokens stream through a register tile."""

    kind = "gemm"
    knobs = (
        Knob("tokens_per_tile", 2, (1, 2, 3, 4, 6, 8), "tokens sharing each unpacked weight vector"),
        TILES_PER_TASK,
        TASK_ORDER,
        LANES,
        GROUP_UNROLL,
        Knob("prefetch_bytes", 0, (0, 1024, 2048, 4096, 8192), "software prefetch distance in the weight stream"),
        PREFETCH_LOCALITY,
    )

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return req.m != 1 and self.isa_applies(target) and int_matmul_applies(req)

    def default_knobs(self, req: KernelRequest, target: TargetPreset) -> dict[str, int]:
        # Registers: tokens x slots accumulators, twice (high and low bytes) for 16-bit activations. Measured on
        # SmolLM2's FFN matmuls at 256 tokens (AVX-512 VNNI): 2 x 1 is fastest for 16-bit, 4 x 1 for 8-bit.
        # With 256-bit registers, half tiles let as many tokens share a weight vector.
        knobs = super().default_knobs(req, target)
        knobs["tokens_per_tile"] = 2 if int(req.attr("act_bits", 8)) == 16 else 4
        knobs["lanes"] = 16 if self.isa is IsaClass.AVX512_VNNI else 8
        return knobs


__all__ = ["IntGemmRule", "IntGemvRule", "build_int_matmul", "int_matmul_applies"]
