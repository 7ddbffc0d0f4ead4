"""The fused feed-forward block: x + down(silu(gate(n)) * up(n)) with n = RMSNorm(x), in one kernel.

Each task of the first parallel phase computes 32 rows of gate and the same 32 rows of up for every
token, applies SiLU * mul in registers and quantises that group of the intermediate for the down
projection: the intermediate is never written as floats and never read back by another kernel. The
second phase is the down projection (with the residual) over the quantised intermediate.
"""

from __future__ import annotations

from typing import Mapping

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script.builder import ir as I

from ..compiler.graph import OpKind
from ..quant.tiled import TILED_COMPONENTS
from ..targets import TargetPreset
from .rule import KernelRequest, Knob, Rule
from .vecmath import sigmoid_f32
from .int_acts import L, Acts, quantize_group, quantize_row
from .int_kernel import (PREFETCH_LOCALITY, QUANTIZED, default_locality, for_token_tiles, micro_kernel, store_epilogue,
                         tile_rows, without_moot_locality)
from .intdot import Dot, dot_for


def build_int_ffn(req: KernelRequest, dot: Dot, tokens_per_tile: int, prefetch_bytes: int, down_tiles: int = 1,
                  prefetch_locality: int = 0):
    gu_q = req.qtype
    F2, D = req.weight_shape  # gate and up rows stacked: [2 * d_ff, d_model]
    F = F2 // 2
    (dn_q, dn_rows, dn_cols, _), = req.more_weights  # down: [d_model, d_ff]
    bits = int(req.attr("act_bits", 8))
    eps = float(req.attr("norm_eps"))
    with IRBuilder() as ib:
        with I.prim_func():
            I.func_name("int_ffn")
            I.func_attr({"tirx.noalias": True})
            n_tok = req.m if req.m is not None else tirx.Var("T", "int64")
            x = I.arg("x", I.buffer((n_tok, D), "float32"))  # [T, d_model], also the residual
            gu = {c.name: I.arg(f"gu_{c.name}", I.buffer(c.shape(F2, D), c.dtype)) for c in TILED_COMPONENTS[gu_q]}
            dn = {c.name: I.arg(f"down_{c.name}", I.buffer(c.shape(dn_rows, dn_cols), c.dtype)) for c in TILED_COMPONENTS[dn_q]}
            gain = I.arg("norm", I.buffer((D,), "float32"))
            out = I.arg("out", I.buffer((n_tok, D), "float32"))
            ax = Acts.alloc(n_tok, D, bits)  # the normalised input
            ah = Acts.alloc(n_tok, F, bits)  # the intermediate silu(gate) * up
            with (I.serial if req.m == 1 else I.parallel)(0, n_tok) as t:
                quantize_row(x, t, gain, eps, D, ax, t)

            with I.parallel(0, F // 32) as c:  # 32 intermediate values per task: gate tiles 2c, 2c+1 and up's
                tiles = [2 * c, 2 * c + 1, F // L + 2 * c, F // L + 2 * c + 1]

                def gate_up(t0, tt):
                    def finish(accs):
                        for i in range(tt):
                            g0, g1, u0, u1 = accs[i]
                            h = [I.Bind(g0 * sigmoid_f32(g0) * u0), I.Bind(g1 * sigmoid_f32(g1) * u1)]
                            quantize_group(h, t0 + i, c, ah)

                    micro_kernel(dot, gu_q, gu, tile_rows(tiles), t0, tt, D, ax, None, prefetch_bytes, prefetch_locality, finish=finish)

                for_token_tiles(req.m, n_tok, tokens_per_tile, gate_up)

            store = store_epilogue(out, x, None)
            dt = down_tiles if (D // L) % down_tiles == 0 else 1
            with I.parallel(0, D // L // dt) as task:
                tiles_dn = [task * dt + j for j in range(dt)]
                for_token_tiles(
                    req.m, n_tok, tokens_per_tile,
                    lambda t0, tt: micro_kernel(dot, dn_q, dn, tile_rows(tiles_dn), t0, tt, F, ah, store, prefetch_bytes, prefetch_locality),
                )
    return ib.get()


class IntFfnRule(Rule):
    name = "int_ffn"
    knobs = (
        Knob("tokens_per_tile", 1, (1, 2, 4), "tokens sharing each unpacked weight vector (chunks of tokens)"),
        Knob("down_tiles", 2, (1, 2), "row tiles of 16 per down-projection task"),
        Knob("prefetch_bytes", 4096, (0, 2048, 4096, 8192), "software prefetch distance in the weight streams"),
        PREFETCH_LOCALITY,
    )

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return (
            req.kind is OpKind.FFN
            and dot_for(target) is not None
            and req.qtype in QUANTIZED
            and req.more_weights[0][0] in QUANTIZED
            and (req.weight_shape[0] // 2) % 32 == 0
        )

    def default_knobs(self, req: KernelRequest, target: TargetPreset) -> dict[str, int]:
        knobs = super().default_knobs(req, target)
        if req.m == 1:
            knobs["down_tiles"] = 1
        knobs["prefetch_locality"] = default_locality(target)
        return knobs

    def canonical(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]) -> dict[str, int]:
        return without_moot_locality(knobs, target)

    def active_knobs(self, req: KernelRequest, target: TargetPreset) -> tuple[Knob, ...]:
        # one token: every token tile is that token, whatever its size
        return tuple(k for k in self.knobs if not (req.m == 1 and k.name == "tokens_per_tile"))

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        return build_int_ffn(req, dot_for(target), knobs["tokens_per_tile"], knobs["prefetch_bytes"], knobs["down_tiles"],
                             knobs["prefetch_locality"])
