"""GEMM (a chunk of tokens): a dequantised weight tile per task, reused by a register-tiled micro-kernel."""

from __future__ import annotations

from typing import Mapping

import tvm
from tvm import te

from ..compiler.graph import OpKind
from ..targets import TargetPreset
from .matmul import matmul_stages
from .rule import KernelRequest, Knob, Rule


class GemmRule(Rule):
    name = "gemm"
    knobs = (
        Knob("tile_n", 32, (16, 32, 48, 64), "output columns per task (weight tile width)"),
        Knob("tile_t", 6, (2, 4, 6, 8), "tokens per register tile"),
    )

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return (
            req.kind in (OpKind.MATMUL, OpKind.LM_HEAD) and req.m != 1 and req.in_cols[0] is None and req.attr("layout", "rows") == "rows"
        )

    def default_knobs(self, req: KernelRequest, target: TargetPreset) -> dict[str, int]:
        knobs = super().default_knobs(req, target)
        knobs["tile_n"] = max(knobs["tile_n"], 2 * target.f32_lanes) if target.f32_lanes > 16 else knobs["tile_n"]
        return knobs

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        lanes = target.f32_lanes
        tile_n, tile_t = knobs["tile_n"], knobs["tile_t"]
        if tile_n % lanes:
            raise ValueError(f"tile_n {tile_n} must be a multiple of the vector width {lanes}")
        st = matmul_stages(req, weight_tile=True)
        sch = tvm.s_tir.Schedule(te.create_prim_func(st.params))
        y, wt = sch.get_sblock("y"), sch.get_sblock("wt")
        t, n, k = sch.get_loops(y)
        n_o, n_i = sch.split(n, [None, tile_n])
        t_o, t_i = sch.split(t, [None, tile_t])
        n_io, n_ii = sch.split(n_i, [None, lanes])
        sch.reorder(n_o, t_o, k, t_i, n_io, n_ii)
        # Accumulate a [tile_t, tile_n] tile in registers; write it (plus epilogue) once.
        acc = sch.cache_write(y, 0, "global")
        sch.reverse_compute_at(acc, t_o)
        if st.out is not st.y:
            sch.reverse_compute_inline(sch.get_sblock("out"))
        # Dequantise the [K, tile_n] weight tile once per task; every token chunk reuses it.
        sch.compute_at(wt, n_o)
        wk, wn = sch.get_loops(wt)[-2:]
        sch.reorder(wn, wk)
        sch.parallel(n_o)
        sch.vectorize(n_ii)
        sch.unroll(n_io)
        sch.unroll(t_i)
        sch.decompose_reduction(y, k)
        sch.vectorize(sch.get_loops(acc)[-1])
        if st.norm_stages:
            xn = sch.get_sblock("xnorm")
            tx, kx = sch.get_loops(xn)
            sch.compute_at(sch.get_sblock("rstd"), tx)
            sch.compute_at(sch.get_sblock("sumsq"), tx)
            sch.parallel(tx)
            sch.vectorize(kx)
        return sch.mod["main"]
