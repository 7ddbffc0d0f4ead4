"""Integer matmuls on AVX-512 VNNI: int8 activations times packed low-bit weights with `vpdpbusd`.

Activations are quantised per 32 inputs (scale = max |x| / 127, as llama.cpp's Q8), fused with the
RMSNorm prologue. Weights are in the tile16 layout (quant/tiled.py): lane r of every vector is output
row 16 * tile + r, so one 64-byte load feeds 16 rows and per-row scales are plain vectors. Each group of
inputs sharing a weight scale is summed exactly in int32, then scaled into float32 accumulators:

  Q4_0  y += d dx (acc - 8 sq)          Q4_1  y += d dx acc + m dx sq      Q8_0  y += d dx (acc - 128 sq)
  Q4_K  y += (d sc) dx acc - (dmin mn) dx sq                           Q6_K  y += (d sc) dx (acc - 32 sq)

(acc: sum of quant x xq over the group, sq: sum of xq, dx: the activation scale.) The only error is the
int8 rounding of activations (relative 1/254 of a group's largest value).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script.builder import ir as I

from ..compiler.graph import OpKind
from ..quant import QuantType
from ..quant.tiled import TILED_COMPONENTS
from ..targets import TargetPreset
from .rule import KernelRequest, Knob, Rule
from .vecmath import hmax, hsum

L = 16  # lanes: output rows per tile
F32, I32 = "float32x16", "int32x16"
QUANTIZED = (QuantType.Q4_0, QuantType.Q4_1, QuantType.Q8_0, QuantType.Q4_K, QuantType.Q6_K)


def _ramp(base, n=L):
    return tirx.Ramp(base, 1, n)


def _splat(v, dtype: str):
    return tirx.Broadcast(tirx.const(v, dtype.split("x")[0]), L) if isinstance(v, (int, float)) else tirx.Broadcast(v, L)


def vpdpbusd(acc, a_u8, b_s8):
    return tirx.call_llvm_pure_intrin(I32, "llvm.x86.avx512.vpdpbusd.512", acc, a_u8, b_s8)


def _bytes(v):
    return tirx.reinterpret("int8x64", v)


M4 = 0x0F0F0F0F
M30 = 0x30303030


@dataclass(frozen=True)
class _Operand:
    weights: tirx.PrimExpr  # u8 x 64 (as int8x64): 4 inputs for each of 16 rows
    inputs: int  # offset, within the group, of the 4 activations it multiplies


def _operands(qtype: QuantType, w, tile, g) -> list[_Operand]:
    """vpdpbusd operands of one input group of one row tile."""
    u32 = lambda v: _splat(v, "uint32x16")  # noqa: E731
    if qtype is QuantType.Q8_0:
        return [_Operand(_bytes(w["qs"][tile, g * 8 + i, _ramp(0)]), 4 * i) for i in range(8)]
    if qtype is QuantType.Q6_K:
        h = w["qh"][tile, g, _ramp(0)]
        ops = []
        for o, (lo_h, hi_h) in enumerate(((h & u32(M30), (h >> u32(2)) & u32(M30)),
                                          ((h << u32(4)) & u32(M30), (h << u32(2)) & u32(M30)))):
            ql = w["ql"][tile, g * 2 + o, _ramp(0)]
            ops.append(_Operand(_bytes((ql & u32(M4)) | lo_h), 8 * o))
            ops.append(_Operand(_bytes(((ql >> u32(4)) & u32(M4)) | hi_h), 8 * o + 4))
        return ops
    ops = []
    for o in range(4):  # 4-bit quants: 4 octets of inputs per group of 32
        word = w["qs"][tile, g * 4 + o, _ramp(0)]
        ops.append(_Operand(_bytes(word & u32(M4)), 8 * o))
        ops.append(_Operand(_bytes((word >> u32(4)) & u32(M4)), 8 * o + 4))
    return ops


def _group_size(qtype: QuantType) -> int:
    return 16 if qtype is QuantType.Q6_K else 32


def _scale_update(qtype: QuantType, w, tile, g, acc, dx, sq) -> tirx.PrimExpr:
    """What one group adds to the float32 accumulator: acc (int32x16), dx (f32 scalar), sq (int32 scalar)."""
    f = lambda v: tirx.Cast(F32, v)  # noqa: E731
    dxv = _splat(dx, F32)
    if qtype is QuantType.Q4_0:
        return f(w["d"][tile, g, _ramp(0)]) * dxv * f(acc - _splat(sq * 8, I32))
    if qtype is QuantType.Q8_0:
        return f(w["d"][tile, g, _ramp(0)]) * dxv * f(acc - _splat(sq * 128, I32))
    if qtype is QuantType.Q4_1:
        return f(w["d"][tile, g, _ramp(0)]) * dxv * f(acc) + f(w["m"][tile, g, _ramp(0)]) * _splat(dx * tirx.Cast("float32", sq), F32)
    if qtype is QuantType.Q4_K:
        sb = g // 8
        scale = f(w["d"][tile, sb, _ramp(0)]) * f(w["sc"][tile, g, _ramp(0)])
        minimum = f(w["dmin"][tile, sb, _ramp(0)]) * f(w["mn"][tile, g, _ramp(0)])
        return scale * dxv * f(acc) - minimum * _splat(dx * tirx.Cast("float32", sq), F32)
    if qtype is QuantType.Q6_K:
        scale = f(w["d"][tile, g // 16, _ramp(0)]) * f(w["sc"][tile, g, _ramp(0)])
        return scale * dxv * f(acc - _splat(sq * 32, I32))
    raise AssertionError(qtype)


@dataclass(frozen=True)
class Acts:
    """Quantised activations of a kernel: xq (int8, 16-bit: high bytes), xl (16-bit: low bytes, else None),
    dx (scale per 32 inputs), sq (sum of the quantised values per 16 inputs). All are [tokens, ...]."""

    xq: object
    xl: object
    dx: object
    sq: object

    @classmethod
    def alloc(cls, n_tok, K: int, bits: int) -> Acts:
        return cls(
            I.alloc_buffer((n_tok, K), "int8"),
            I.alloc_buffer((n_tok, K), "int8") if bits == 16 else None,
            I.alloc_buffer((n_tok, K // 32), "float32"),
            I.alloc_buffer((n_tok, K // 16), "int32"),
        )


def build_vnni_matmul(req: KernelRequest, tokens_per_tile: int, tiles_per_task: int, prefetch_bytes: int, prefetch_nta: bool):
    """The PrimFunc (x, [residual], *weights, [norm], [bias], out) for a tile16 weight.

    `req.attr("act_bits")` is 8 (one vpdpbusd per weight vector and token) or 16 (two: high and low byte).
    """
    bits = int(req.attr("act_bits", 8))
    qtype = req.qtype
    N, K = req.weight_shape
    NT = N // L
    tpt = tiles_per_task if NT % tiles_per_task == 0 else 1
    eps = float(req.attr("norm_eps", 0.0))
    last_row = bool(req.attr("last_row"))
    has_res, has_norm, has_bias = bool(req.attr("residual")), "norm" in req.vectors, "bias" in req.vectors

    with IRBuilder() as ib:
        with I.prim_func():
            I.func_name("vnni_matmul")
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
            with I.parallel(0, NT // tpt) as task:
                tiles = [task * tpt + j for j in range(tpt)]
                for_token_tiles(
                    req.m, n_tok, tokens_per_tile,
                    lambda t0, tt: micro_kernel(qtype, w, tiles, t0, tt, K, acts, store, prefetch_bytes, prefetch_nta),
                )
    return ib.get()


def for_token_tiles(m, n_tok, tokens_per_tile: int, body) -> None:
    """body(t0, tt) over tiles of `tokens_per_tile` tokens, then single tokens for the remainder."""
    tt = min(tokens_per_tile, m) if m is not None else tokens_per_tile
    if m is not None and m % tt == 0:
        with I.serial(0, m // tt) as tb:
            body(tb * tt, tt)
        return
    with I.serial(0, n_tok // tt) as tb:
        body(tb * tt, tt)
    with I.serial(n_tok // tt * tt, n_tok) as t:
        body(t, 1)


def quantize_group(vs, t, b, acts: Acts) -> None:
    """Quantise 32 values (two 16-lane vectors) as group b of token t.

    8-bit: q = round(v / dx), |q| <= 127. 16-bit: |q| <= 32639 is split as q = 256 xq + xl with both
    halves in [-128, 127], so two int8 dot products give the exact 16-bit one.
    """
    xl = acts.xl
    qmax = tirx.const(127.0 if xl is None else 32639.0, "float32")
    amax = I.Bind(hmax(tirx.max(tirx.abs(vs[0]), tirx.abs(vs[1]))))
    inv = I.Bind(tirx.Select(amax > tirx.const(0.0, "float32"), qmax / amax, tirx.const(0.0, "float32")))
    I.buffer_store(acts.dx, amax / qmax, [t, b])
    for h in range(2):
        q = I.Bind(tirx.Cast(I32, tirx.round(vs[h] * _splat(inv, F32))))
        cols = _ramp(b * 32 + h * L)
        if xl is None:
            I.buffer_store(acts.xq, tirx.Cast("int8x16", q), [t, cols])
        else:
            lo = I.Bind(((q + _splat(128, I32)) & _splat(255, I32)) - _splat(128, I32))
            I.buffer_store(xl, tirx.Cast("int8x16", lo), [t, cols])
            I.buffer_store(acts.xq, tirx.Cast("int8x16", (q - lo) >> _splat(8, I32)), [t, cols])
        I.buffer_store(acts.sq, hsum(q), [t, b * 2 + h])


def quantize_row(x, src_row, gain, eps: float, K: int, acts: Acts, t) -> None:
    """Token t's activations from x[src_row] (times rstd * gain when RMSNorm is fused), per 32 inputs."""
    scale = None
    if gain is not None:
        ss = I.alloc_buffer((L,), "float32")
        I.buffer_store(ss, _splat(0.0, F32), [_ramp(0)])
        with I.serial(0, K // L) as c:
            v = x[src_row, _ramp(c * L)]
            I.buffer_store(ss, ss[_ramp(0)] + v * v, [_ramp(0)])
        scale = I.Bind(tirx.const(1.0, "float32") / tirx.sqrt(hsum(ss[_ramp(0)]) / tirx.const(float(K), "float32") + tirx.const(eps, "float32")))
    with I.serial(0, K // 32) as b:
        vs = []
        for h in range(2):
            v = x[src_row, _ramp(b * 32 + h * L)]
            if gain is not None:
                v = v * _splat(scale, F32) * gain[_ramp(b * 32 + h * L)]
            vs.append(I.Bind(v))
        quantize_group(vs, t, b, acts)


def store_epilogue(out, res, bias):
    """The usual epilogue: out[t, tile rows] = acc (+ bias) (+ residual)."""

    def store(t, tile, acc) -> None:
        cols = _ramp(tile * L)
        v = acc
        if bias is not None:
            v = v + bias[cols]
        if res is not None:
            v = v + res[t, cols]
        I.buffer_store(out, v, [t, cols])

    return store


def micro_kernel(qtype, w, tiles: list, t0, tt: int, K: int, acts: Acts, epilogue, pf_bytes: int = 0, pf_nta: bool = True,
                 finish=None) -> None:
    """Row tiles `tiles` x tokens [t0, t0 + tt): int32 sums per group of inputs, float32 accumulation.

    Then epilogue(t, tile, acc) per token and tile, or, with `finish`, finish(accs) once with
    accs[i][j] the accumulator of token i and tile j (for epilogues that combine tiles).
    """
    G = _group_size(qtype)
    nt = len(tiles)
    facc = I.alloc_buffer((tt * nt * L,), "float32")
    iacc = I.alloc_buffer((tt * nt * L,), "int32")
    lacc = I.alloc_buffer((tt * nt * L,), "int32") if acts.xl is not None else None  # low-byte sums
    slot = lambda i, j: _ramp((i * nt + j) * L)  # noqa: E731  token i, tile j
    for s in range(tt * nt):
        I.buffer_store(facc, _splat(0.0, F32), [_ramp(s * L)])
    annotations = None
    if pf_bytes:
        names = [w[c].name for c in (("ql", "qh") if qtype is QuantType.Q6_K else ("qs",))]  # the quant streams
        annotations = {"ellm.prefetch": {"buffers": names, "bytes": pf_bytes, "locality": 0 if pf_nta else 3}}
    accs = [(iacc, acts.xq)] + ([(lacc, acts.xl)] if lacc is not None else [])
    with I.serial(0, K // G, annotations=annotations) as g:
        for s in range(tt * nt):
            for acc, _ in accs:
                I.buffer_store(acc, _splat(0, I32), [_ramp(s * L)])
        for j, tile in enumerate(tiles):
            for op in _operands(qtype, w, tile, g):
                a = I.Bind(op.weights)
                for i in range(tt):
                    for acc, xs in accs:
                        xb = tirx.reinterpret("int32", xs[t0 + i, tirx.Ramp(g * G + op.inputs, 1, 4)])
                        I.buffer_store(acc, vpdpbusd(acc[slot(i, j)], a, _bytes(tirx.Broadcast(xb, L))), [slot(i, j)])
        if lacc is not None:  # 16-bit activations: sum = 256 * high + low (fits int32: |sum| < 2**28)
            for s in range(tt * nt):
                I.buffer_store(iacc, (iacc[_ramp(s * L)] << _splat(8, I32)) + lacc[_ramp(s * L)], [_ramp(s * L)])
        for i in range(tt):
            dxi = acts.dx[t0 + i, g * G // 32]
            sqi = acts.sq[t0 + i, g * 2] + acts.sq[t0 + i, g * 2 + 1] if G == 32 else acts.sq[t0 + i, g]
            for j, tile in enumerate(tiles):
                upd = _scale_update(qtype, w, tile, g, iacc[slot(i, j)], dxi, sqi)
                I.buffer_store(facc, facc[slot(i, j)] + upd, [slot(i, j)])
    if finish is not None:
        finish([[facc[slot(i, j)] for j in range(nt)] for i in range(tt)])
        return
    for i in range(tt):
        for j, tile in enumerate(tiles):
            epilogue(t0 + i, tile, facc[slot(i, j)])


def vnni_applies(req: KernelRequest, target: TargetPreset) -> bool:
    return (
        req.kind in (OpKind.MATMUL, OpKind.LM_HEAD)
        and target.vnni
        and req.qtype in QUANTIZED
        and req.attr("layout") == "tile16"
        and req.in_cols[0] is None
    )


class VnniGemvRule(Rule):
    """One token: phase 1 quantises x, phase 2 streams every weight once (prefetched ahead)."""

    name = "vnni_gemv"
    knobs = (
        Knob("tiles_per_task", 1, (1, 2, 4), "row tiles of 16 a task accumulates together"),
        Knob("prefetch_bytes", 4096, (0, 1024, 4096, 8192), "software prefetch distance in the weight stream"),
        Knob("prefetch_nta", 1, (0, 1), "prefetchnta (1) or prefetcht0 (0)"),
    )

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return req.m == 1 and vnni_applies(req, target)

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        return build_vnni_matmul(req, 1, knobs["tiles_per_task"], knobs["prefetch_bytes"], bool(knobs["prefetch_nta"]))


class VnniGemmRule(Rule):
    """A chunk of tokens: a task's weights stay in L1 while its tokens stream through a register tile."""

    name = "vnni_gemm"
    knobs = (
        Knob("tokens_per_tile", 2, (1, 2, 4, 6, 8), "tokens sharing each unpacked weight vector"),
        Knob("tiles_per_task", 1, (1, 2, 4), "row tiles of 16 sharing each activation broadcast"),
        Knob("prefetch_bytes", 0, (0, 4096), "software prefetch distance in the weight stream"),
    )

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return req.m != 1 and vnni_applies(req, target)

    def default_knobs(self, req: KernelRequest, target: TargetPreset) -> dict[str, int]:
        # Registers: tokens x tiles accumulators, twice (high and low bytes) for 16-bit activations.
        # Measured on SmolLM2's FFN matmuls at 256 tokens: 2 x 1 is fastest for 16-bit, 4 x 1 for 8-bit.
        knobs = super().default_knobs(req, target)
        knobs["tokens_per_tile"] = 2 if int(req.attr("act_bits", 8)) == 16 else 4
        return knobs

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        return build_vnni_matmul(req, knobs["tokens_per_tile"], knobs["tiles_per_task"], knobs["prefetch_bytes"], True)


__all__ = ["VnniGemmRule", "VnniGemvRule", "build_vnni_matmul"]
