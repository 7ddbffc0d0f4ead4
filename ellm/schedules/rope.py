"""RoPE and KV-cache append kernels (TVMScript: they write the cache in place).

The cache layout is attention.py's: K transposed in blocks of 16 keys, V row-major.

The rotation table is an input, `rope[pos, :half] = cos`, `rope[pos, half:] = sin`, computed once per
engine in float64 (so scaling variants live in one NumPy function, runtime/rope.py).
Adjacent-pair models (llama GGUF) rotate (2i, 2i+1); NeoX-style models (qwen2) rotate (i, i + half).
"""

from __future__ import annotations

from typing import Mapping

from tvm.script import tirx as T

from ..compiler.graph import OpKind
from ..targets import TargetPreset
from .attention import KB
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


class KvAppendRule(Rule):
    name = "kv_append"

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return req.kind is OpKind.KV_APPEND

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        cache_t, k_t, v_t = req.in_types
        L, Hkv, _, hd = cache_t.shape
        dt = cache_t.dtype
        Wk, Wv = k_t.width, v_t.width
        k0, v0 = _col0(req, 1), _col0(req, 2)

        @T.prim_func
        def kv_append(kc_h: T.handle, vc_h: T.handle, k_h: T.handle, v_h: T.handle, pos: T.int64, layer: T.int64):
            T.func_attr({"tirx.noalias": True})
            n, C, CB = T.int64(), T.int64(), T.int64()
            kc = T.match_buffer(kc_h, (L, Hkv, CB, hd, KB), dt)  # [n_layers, n_kv_heads, ctx/16, head_dim, 16]
            vc = T.match_buffer(vc_h, (L, Hkv, C, hd), dt)  # [n_layers, n_kv_heads, ctx, head_dim]
            k = T.match_buffer(k_h, (n, Wk), "float32")
            v = T.match_buffer(v_h, (n, Wv), "float32")
            for t in T.parallel(n):
                for h in range(Hkv):
                    for d in T.vectorized(hd):
                        kc[layer, h, (pos + t) // KB, d, (pos + t) % KB] = T.Cast(dt, k[t, k0 + h * hd + d])
                        vc[layer, h, pos + t, d] = T.Cast(dt, v[t, v0 + h * hd + d])

        return kv_append


class RopeKvAppendRule(Rule):
    name = "rope_kv_append"

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return req.kind is OpKind.ROPE_KV_APPEND

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        cache_t, qkv_t = req.in_types
        L, Hkv, _, hd = cache_t.shape
        dt = cache_t.dtype
        H = int(req.attr("n_heads"))
        rd, half, neox = _geometry(req)
        p0, p1, first, second = _rotation(neox, half)
        W = qkv_t.width
        k0, v0 = H * hd, H * hd + Hkv * hd  # [q | k | v] columns of the fused projection

        @T.prim_func
        def rope_kv_append(
            kc_h: T.handle, vc_h: T.handle, qkv_h: T.handle, tab_h: T.handle, pos: T.int64, layer: T.int64, q_h: T.handle
        ):
            T.func_attr({"tirx.noalias": True})
            n, C, CB = T.int64(), T.int64(), T.int64()
            kc = T.match_buffer(kc_h, (L, Hkv, CB, hd, KB), dt)  # [n_layers, n_kv_heads, ctx/16, head_dim, 16]
            vc = T.match_buffer(vc_h, (L, Hkv, C, hd), dt)  # [n_layers, n_kv_heads, ctx, head_dim]
            qkv = T.match_buffer(qkv_h, (n, W), "float32")  # [T, q | k | v]
            tab = T.match_buffer(tab_h, (C, rd), "float32")
            q = T.match_buffer(q_h, (n, H * hd), "float32")
            for t in T.parallel(n):
                for h in range(H):
                    for i in T.vectorized(half):
                        q[t, h * hd + p0(i)] = first(qkv, tab, pos, t, h * hd, i)
                        q[t, h * hd + p1(i)] = second(qkv, tab, pos, t, h * hd, i)
                    for d in range(rd, hd):
                        q[t, h * hd + d] = qkv[t, h * hd + d]
                for h in range(Hkv):
                    for i in T.vectorized(half):
                        kc[layer, h, (pos + t) // KB, p0(i), (pos + t) % KB] = T.Cast(dt, first(qkv, tab, pos, t, k0 + h * hd, i))
                        kc[layer, h, (pos + t) // KB, p1(i), (pos + t) % KB] = T.Cast(dt, second(qkv, tab, pos, t, k0 + h * hd, i))
                    for d in range(rd, hd):
                        kc[layer, h, (pos + t) // KB, d, (pos + t) % KB] = T.Cast(dt, qkv[t, k0 + h * hd + d])
                    for d in T.vectorized(hd):
                        vc[layer, h, pos + t, d] = T.Cast(dt, qkv[t, v0 + h * hd + d])

        return rope_kv_append
