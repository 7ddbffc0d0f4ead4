"""GEMV (one token): packed weights streamed once, dequantised in registers, lanes along the in-block axis."""

from __future__ import annotations

from typing import Mapping

import tvm
from tvm import te

from ..compiler.graph import OpKind
from ..targets import TargetPreset
from .matmul import matmul_stages
from .rule import KernelRequest, Knob, Rule


def loops_by_name(sch, block) -> dict[str, object]:
    return {str(sch.get(lp).loop_var.name): lp for lp in sch.get_loops(block)}


class GemvRule(Rule):
    name = "gemv"
    knobs = (
        Knob("rows_per_task", 8, (1, 2, 4, 8, 16, 32), "output rows per parallel task"),
        Knob("block_unroll", 1, (1, 2, 4), "quant blocks unrolled per reduction step"),
    )

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return (
            req.kind in (OpKind.MATMUL, OpKind.LM_HEAD) and req.m == 1 and req.in_cols[0] is None and req.attr("layout", "rows") == "rows"
        )

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        st = matmul_stages(req, weight_tile=False)
        sch = tvm.s_tir.Schedule(te.create_prim_func(st.params))
        y = sch.get_sblock("y")
        inner = f"ks{len(st.fmt.sub_axes) - 1}"
        # y_rf[t, n, lane]: one partial sum per vector lane; y then sums the lanes.
        rf = sch.rfactor(loops_by_name(sch, y)[inner], factor_axis=2)
        lp = loops_by_name(sch, rf)
        subs = [lp[f"ks{i}"] for i in range(len(st.fmt.sub_axes))]
        kb_o, kb_i = sch.split(lp["kb"], [None, knobs["block_unroll"]])
        sch.reorder(lp["n"], kb_o, kb_i, *subs)
        n_o, n_i = sch.split(lp["n"], [None, knobs["rows_per_task"]])
        sch.parallel(n_o)
        sch.vectorize(subs[-1])
        for s in subs[:-1]:
            sch.unroll(s)
        if knobs["block_unroll"] > 1:
            sch.unroll(kb_i)
        sch.reverse_compute_at(y, n_i)
        if st.out is not st.y:
            sch.reverse_compute_at(sch.get_sblock("out"), n_i)
        sch.decompose_reduction(rf, kb_o)
        if st.norm_stages:
            sch.vectorize(sch.get_loops(sch.get_sblock("xnorm"))[-1])
        return sch.mod["main"]
