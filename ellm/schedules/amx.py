"""Prefill / verification matmuls on AMX tiles (Sapphire Rapids and later): `tdpbsud` on 16 x 16 tiles.

Same weights (tile16) and activations (int8 or two int8 halves, per 32 inputs) as the VNNI kernels. Per
task (16 output rows): the row tile's quants are unpacked once into a [K/4, 64]-byte scratch, which is
exactly AMX's B layout (4 consecutive inputs of each of 16 rows per 64-byte row). Then for every
16-token tile and every group of inputs sharing a weight scale:

    C (16 tokens x 16 rows, int32) = A (16 tokens x group, int8 activations) . B (group/4 x 64, u8 weights)

and C is scaled into float32 exactly as the VNNI kernel does. Tokens past the last full tile of 16 use
the AVX-512 VNNI micro-kernel. Linux only lets a process use AMX after it asks (runtime/amx.py).
"""

from __future__ import annotations

from typing import Mapping

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script.builder import ir as I

from ..quant.tiled import TILED_COMPONENTS
from ..targets import TargetPreset
from .rule import KernelRequest, Rule
from ..targets import IsaClass
from .int_acts import I32, L, Acts, quantize_row
from .int_acts import ramp as _ramp
from .int_acts import splat as _splat
from .int_kernel import Rows, accumulate, group_size, micro_kernel, operands, store_epilogue
from .int_matmul import int_matmul_applies
from .intdot import Dot

TOK = 16  # tokens per AMX tile (rows of A and C)
VNNI = Dot(IsaClass.AVX512_VNNI, 512)  # the tail tokens
C_HI, C_LO, A_HI, A_LO, B = 0, 1, 2, 3, 4  # tile registers


class _TileUnit:
    """The AMX operations the kernel uses: real instructions, or (emulate=True) a software model with the
    same semantics, so the kernel's layouts and scaling can be tested on CPUs without AMX."""

    def __init__(self, G: int, emulate: bool):
        self.G, self.emulate = G, emulate
        # (rows, bytes per row) of each tile register we use
        self.shape = {C_HI: (TOK, 64), C_LO: (TOK, 64), A_HI: (TOK, G), A_LO: (TOK, G), B: (G // 4, 64)}

    def _call(self, name: str, *args):
        I.evaluate(tirx.call_llvm_intrin("void", f"llvm.x86.{name}", *args))

    def configure(self) -> None:
        """Palette 1: C tiles 16 x 16 int32, A tiles 16 tokens x G bytes, B tile G/4 x 64 bytes."""
        if self.emulate:
            self.regs = I.alloc_buffer((8 * 1024,), "uint8")  # tile registers holding bytes (A, B)
            self.cregs = I.alloc_buffer((2 * TOK * 16,), "int32")  # the two int32 C tiles
            return
        cfg = I.alloc_buffer((64,), "uint8")
        for i in range(64):
            I.buffer_store(cfg, tirx.IntImm("uint8", 0), [i])
        I.buffer_store(cfg, tirx.IntImm("uint8", 1), [0])
        for tile, (rows, colsb) in self.shape.items():
            I.buffer_store(cfg, tirx.IntImm("uint8", colsb & 0xFF), [16 + 2 * tile])
            I.buffer_store(cfg, tirx.IntImm("uint8", colsb >> 8), [17 + 2 * tile])
            I.buffer_store(cfg, tirx.IntImm("uint8", rows), [48 + tile])
        self._call("ldtilecfg", tirx.address_of(cfg[0]))

    def zero(self, c: int) -> None:
        if self.emulate:
            for i in range(TOK):
                I.buffer_store(self.cregs, _splat(0, I32), [_ramp(c * TOK * 16 + i * 16)])
        else:
            self._call("tilezero", tirx.IntImm("int8", c))

    def load(self, t: int, buf, first, stride: int) -> None:
        """Tile t <- rows of buf: row r starts at flat element first + r * stride (1-byte elements)."""
        if self.emulate:
            rows, colsb = self.shape[t]
            flat = I.decl_buffer((1 << 40,), buf.dtype, data=buf.data)
            with I.serial(0, rows) as r:
                with I.serial(0, colsb) as cb:
                    I.buffer_store(self.regs, tirx.Cast("uint8", flat[first + r * stride + cb]), [t * 1024 + r * 64 + cb])
        else:
            flat = I.decl_buffer((1 << 40,), buf.dtype, data=buf.data)
            self._call("tileloadd64", tirx.IntImm("int8", t), tirx.address_of(flat[first]), tirx.IntImm("int64", stride))

    def dot(self, c: int, a: int, b: int) -> None:
        """C[m][n] += sum over k of int8(A[m][4k + j]) * uint8(B[k][4n + j])  (tdpbsud)."""
        if self.emulate:
            rows_b = self.shape[b][0]
            with I.serial(0, TOK) as m:
                with I.serial(0, 16) as n:
                    acc = I.alloc_buffer((1,), "int32")
                    I.buffer_store(acc, tirx.IntImm("int32", 0), [0])
                    with I.serial(0, rows_b * 4) as kk:
                        av = tirx.Cast("int32", tirx.reinterpret("int8", self.regs[a * 1024 + m * 64 + kk]))
                        bv = tirx.Cast("int32", self.regs[b * 1024 + (kk // 4) * 64 + n * 4 + kk % 4])
                        I.buffer_store(acc, acc[0] + av * bv, [0])
                    I.buffer_store(self.cregs, self.cregs[c * TOK * 16 + m * 16 + n] + acc[0], [c * TOK * 16 + m * 16 + n])
        else:
            self._call("tdpbsud", tirx.IntImm("int8", c), tirx.IntImm("int8", a), tirx.IntImm("int8", b))

    def store(self, c: int, cst, first) -> None:
        """16 rows of 16 int32 from tile c into cst[first:], rows 64 bytes apart."""
        if self.emulate:
            for i in range(TOK):
                I.buffer_store(cst, self.cregs[_ramp(c * TOK * 16 + i * 16)], [_ramp(first + i * 16)])
        else:
            self._call("tilestored64", tirx.IntImm("int8", c), tirx.address_of(cst[first]), tirx.IntImm("int64", 64))

    def release(self) -> None:
        if not self.emulate:
            self._call("tilerelease")


def build_amx_matmul(req: KernelRequest, emulate: bool = False, tail: Dot = VNNI):
    """`emulate`: the software model of the tile unit instead of AMX instructions, with the tail tokens on
    `tail`'s dot products, so the kernel can run on any CPU."""
    qtype = req.qtype
    N, K = req.weight_shape
    G = group_size(qtype)
    NT = N // L
    bits = int(req.attr("act_bits", 8))
    eps = float(req.attr("norm_eps", 0.0))
    has_res, has_norm, has_bias = bool(req.attr("residual")), "norm" in req.vectors, "bias" in req.vectors
    with IRBuilder() as ib:
        with I.prim_func():
            I.func_name("amx_matmul")
            I.func_attr({"tirx.noalias": True})
            n_tok = tirx.Var("T", "int64")
            x = I.arg("x", I.buffer((n_tok, K), "float32"))
            res = I.arg("residual", I.buffer((n_tok, N), "float32")) if has_res else None
            w = {c.name: I.arg(f"w_{c.name}", I.buffer(c.shape(N, K), c.dtype)) for c in TILED_COMPONENTS[qtype]}
            gain = I.arg("norm", I.buffer((K,), "float32")) if has_norm else None
            bias = I.arg("bias", I.buffer((N,), "float32")) if has_bias else None
            out = I.arg("out", I.buffer((n_tok, N), "float32"))
            acts = Acts.alloc(n_tok, K, bits)
            xq, xl, dx = acts.xq, acts.xl, acts.dx
            with I.parallel(0, n_tok) as t:
                quantize_row(x, t, gain, eps, K, acts, t)
            with I.parallel(0, NT) as tile:
                bscr = I.alloc_buffer((K // 4 * 64,), "uint8")  # the row tile's weights, AMX B layout
                with I.serial(0, K // G) as g:
                    for op in operands(qtype, w, Rows(tile), g):
                        row = (g * G + op.inputs) // 4
                        I.buffer_store(bscr, tirx.reinterpret("uint8x64", op.weights), [tirx.Ramp(row * 64, 1, 64)])
                amx = _TileUnit(G, emulate)
                amx.configure()
                cst = I.alloc_buffer((2 * TOK * L,), "int32")  # C tiles stored: [hi | lo][token][row]
                facc = I.alloc_buffer((TOK * L,), "float32")
                with I.serial(0, n_tok // TOK) as tb:
                    for i in range(TOK):
                        I.buffer_store(facc, _splat(0.0, "float32x16"), [_ramp(i * L)])
                    with I.serial(0, K // G) as g:
                        halves = [(C_HI, A_HI, xq)] + ([(C_LO, A_LO, xl)] if xl is not None else [])
                        amx.load(B, bscr, g * (G // 4) * 64, 64)
                        for c_reg, a_reg, xs in halves:
                            amx.zero(c_reg)
                            amx.load(a_reg, xs, tb * TOK * K + g * G, K)
                            amx.dot(c_reg, a_reg, B)
                            amx.store(c_reg, cst, c_reg * TOK * L)
                        for i in range(TOK):
                            t = tb * TOK + i
                            acc = cst[_ramp(i * L)]
                            if xl is not None:  # 16-bit activations: 256 * high + low
                                acc = (acc << _splat(8, I32)) + cst[_ramp(TOK * L + i * L)]
                            new = accumulate(qtype, w, Rows(tile), g, facc[_ramp(i * L)], acc, dx[t, g * G // 32],
                                             acts.ds(t, g, G))
                            I.buffer_store(facc, new, [_ramp(i * L)])
                    for i in range(TOK):
                        cols = _ramp(tile * L)
                        v = facc[_ramp(i * L)]
                        if bias is not None:
                            v = v + bias[cols]
                        if res is not None:
                            v = v + res[tb * TOK + i, cols]
                        I.buffer_store(out, v, [tb * TOK + i, cols])
                amx.release()
                with I.serial(n_tok // TOK * TOK, n_tok) as t:  # the last tokens: VNNI
                    micro_kernel(tail, qtype, w, [Rows(tile)], t, 1, K, acts, store_epilogue(out, res, bias))
    return ib.get()


class AmxGemmRule(Rule):
    """Chunks of tokens on AMX targets (tiles of 16 tokens; the remainder on VNNI)."""

    name = "amx_gemm"

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return target.amx and req.m is None and not req.attr("last_row") and int_matmul_applies(req)

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        return build_amx_matmul(req)
