"""RoPE and KV-cache append kernels (TVMScript: they write the cache in place).

The cache is kv/plan.py's block cache: tokens go into the float16 ring, and blocks the step completes
are copied or quantised into their store (schedules/kv_blocks.py).

The rotation table is an input, `rope[pos, :half] = cos`, `rope[pos, half:] = sin`, computed once per
engine in float64 (so scaling variants live in one NumPy function, runtime/rope.py).
Adjacent-pair models (llama GGUF) rotate (2i, 2i+1); NeoX-style models (qwen2) rotate (i, i + half).
"""

from __future__ import annotations

from typing import Mapping

from tvm import tirx
from tvm.script import tirx as T
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script.builder import ir as I

from ..compiler.graph import OpKind
from ..targets import TargetPreset
from .attention import kv_plan_of
from .kv_blocks import KVBuffers
from .rule import KernelRequest, Rule


def _rotation(neox: bool, half: int):
    """(p0, p1, first, second): the head-relative columns of rotation pair i, and the two rotated values
    of that pair for row t of `src` whose head starts at column `base`, at position pos + t."""
    if neox:
        p0, p1 = (lambda i: i), (lambda i: i + half)
    else:
        p0, p1 = (lambda i: 2 * i), (lambda i: 2 * i + 1)

    def first(src, tab, pos, t, base, i):  # x0 cos - x1 sin
        return src[t, base + p0(i)] * tab[pos + t, i] - src[t, base + p1(i)] * tab[pos + t, half + i]

    def second(src, tab, pos, t, base, i):  # x0 sin + x1 cos
        return src[t, base + p0(i)] * tab[pos + t, half + i] + src[t, base + p1(i)] * tab[pos + t, i]

    return p0, p1, first, second


def _geometry(req: KernelRequest) -> tuple[int, int, bool]:
    """(rope_dim, half, neox)."""
    rope_dim = int(req.attr("rope_dim"))
    return rope_dim, rope_dim // 2, bool(req.attr("neox"))


def _col0(req: KernelRequest, i: int) -> int:
    c = req.in_cols[i]
    return c[0] if c else 0


class RopeRule(Rule):
    name = "rope"

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return req.kind is OpKind.ROPE

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        nh = int(req.attr("n_heads"))
        hd = req.out_types[0].width // nh
        rd, half, neox = _geometry(req)
        p0, p1, first, second = _rotation(neox, half)
        W, c0 = req.in_types[0].width, _col0(req, 0)

        @T.prim_func
        def rope(x_h: T.handle, tab_h: T.handle, pos: T.int64, out_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            n, C = T.int64(), T.int64()
            x = T.match_buffer(x_h, (n, W), "float32")  # [T, W], heads at columns c0..
            tab = T.match_buffer(tab_h, (C, rd), "float32")  # [ctx, cos | sin]
            out = T.match_buffer(out_h, (n, nh * hd), "float32")
            for t in T.parallel(n):
                for h in range(nh):
                    for i in T.vectorized(half):
                        out[t, h * hd + p0(i)] = first(x, tab, pos, t, c0 + h * hd, i)
                        out[t, h * hd + p1(i)] = second(x, tab, pos, t, c0 + h * hd, i)
                    for d in range(rd, hd):
                        out[t, h * hd + d] = x[t, c0 + h * hd + d]

        return rope


def _kv_args(req: KernelRequest):
    """Declare the block-cache buffers, in the order lowering passes them."""
    plan, kt, vt = kv_plan_of(req)
    return plan, KVBuffers.declare(plan, kt, vt)


def _age_blocks(kv: KVBuffers, pos, n, layer, kslot, vslot) -> None:
    """Copy or quantise the blocks this step completed, one task per (K or V, head)."""
    Hkv = kv.plan.n_kv_heads
    first, count = kv.completed_blocks(pos, n)
    with I.parallel(0, 2 * Hkv) as task:
        with I.serial(0, count) as i:
            with I.If(task < Hkv):
                with I.Then():
                    kv.store_k_block(layer, kslot, task, first + i)
                with I.Else():
                    kv.store_v_block(layer, vslot, task - Hkv, first + i)


class KvAppendRule(Rule):
    name = "kv_append"

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return req.kind is OpKind.KV_APPEND and req.attr("kv_plan") is not None

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        _, k_t, v_t = req.in_types
        Wk, Wv = k_t.width, v_t.width
        k0, v0 = _col0(req, 1), _col0(req, 2)
        with IRBuilder() as ib:
            with I.prim_func():
                I.func_name("kv_append")
                I.func_attr({"tirx.noalias": True})
                n = tirx.Var("T", "int64")
                plan, kv = _kv_args(req)
                hd = plan.head_dim
                k = I.arg("k", I.buffer((n, Wk), "float32"))
                v = I.arg("v", I.buffer((n, Wv), "float32"))
                pos, layer, kslot, vslot = KVBuffers.step_args()
                with I.parallel(0, n) as t:
                    for h in range(plan.n_kv_heads):
                        kv.write_k_values(layer, h, pos + t, lambda d, h=h: k[t, k0 + h * hd + d])
                        with I.vectorized(0, hd) as d:
                            kv.write_v_scalar(layer, h, pos + t, d, v[t, v0 + h * hd + d])
                _age_blocks(kv, pos, n, layer, kslot, vslot)
        return ib.get()


class RopeKvAppendRule(Rule):
    name = "rope_kv_append"

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return req.kind is OpKind.ROPE_KV_APPEND and req.attr("kv_plan") is not None

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        _, qkv_t = req.in_types
        H = int(req.attr("n_heads"))
        rd, half, neox = _geometry(req)
        p0, p1, first, second = _rotation(neox, half)
        W = qkv_t.width
        with IRBuilder() as ib:
            with I.prim_func():
                I.func_name("rope_kv_append")
                I.func_attr({"tirx.noalias": True})
                n = tirx.Var("T", "int64")
                plan, kv = _kv_args(req)
                hd, Hkv = plan.head_dim, plan.n_kv_heads
                k0, v0 = H * hd, H * hd + Hkv * hd  # [q | k | v] columns of the fused projection
                qkv = I.arg("qkv", I.buffer((n, W), "float32"))  # [T, q | k | v]
                tab = I.arg("rope", I.buffer((tirx.Var("C", "int64"), rd), "float32"))  # [ctx, cos | sin]
                pos, layer, kslot, vslot = KVBuffers.step_args()
                q = I.arg("q", I.buffer((n, H * hd), "float32"))
                with I.parallel(0, n) as t:
                    for h in range(H):
                        with I.vectorized(0, half) as i:
                            I.buffer_store(q, first(qkv, tab, pos, t, h * hd, i), [t, h * hd + p0(i)])
                            I.buffer_store(q, second(qkv, tab, pos, t, h * hd, i), [t, h * hd + p1(i)])
                        for d in range(rd, hd):
                            I.buffer_store(q, qkv[t, h * hd + d], [t, h * hd + d])
                    for h in range(Hkv):
                        rows = {}  # head-relative column -> its rotated value (pairs of the rotation, then the rest)
                        for i in range(half):
                            rows[p0(i)] = first(qkv, tab, pos, t, k0 + h * hd, i)
                            rows[p1(i)] = second(qkv, tab, pos, t, k0 + h * hd, i)
                        kv.write_k_values(layer, h, pos + t, lambda d, h=h, rows=rows: rows.get(d, qkv[t, k0 + h * hd + d]))
                        with I.vectorized(0, hd) as d:
                            kv.write_v_scalar(layer, h, pos + t, d, qkv[t, v0 + h * hd + d])
                _age_blocks(kv, pos, n, layer, kslot, vslot)
        return ib.get()
