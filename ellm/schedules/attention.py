"""Causal GQA attention over the KV cache: one task per (token, head), online softmax over key blocks.

Query t of a step sits at position pos + t and attends to cache positions 0..pos+t, so one kernel
serves prefill chunks, single-token decode and multi-token verification alike.
"""

from __future__ import annotations

import math
from typing import Mapping

from tvm import tirx
from tvm.script import tirx as T

from ..compiler.graph import OpKind
from ..targets import TargetPreset
from .rule import KernelRequest, Knob, Rule
from .vecmath import exp_f32, hsum


class AttentionRule(Rule):
    name = "attention"
    knobs = (Knob("key_block", 64, (16, 32, 64, 128), "keys scored per online-softmax step"),)

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        if req.kind is not OpKind.ATTENTION:
            return False
        hd = req.in_types[1].shape[-1]
        return req.in_cols == (None, None) and hd % target.f32_lanes == 0

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        q_t, cache_t = req.in_types
        L, Hkv, _, hd = cache_t.shape
        dt = cache_t.dtype
        H = int(req.attr("n_heads"))
        G = H // Hkv
        B = int(knobs["key_block"])
        V = target.f32_lanes
        chunks = hd // V
        scale = 1.0 / math.sqrt(hd)
        f32v = f"float32x{V}"
        NEG = -3.0e38

        def dot(q, kc, t, h, layer, kvh, j):
            """q[t, head h] . K[layer, kvh, j] as `chunks` vector FMAs and one horizontal sum."""
            acc = None
            for c in range(chunks):
                qv = q[t, tirx.Ramp(h * hd + c * V, 1, V)]
                kv = tirx.Cast(f32v, kc[layer, kvh, j, tirx.Ramp(c * V, 1, V)])
                acc = qv * kv if acc is None else acc + qv * kv
            return hsum(acc)

        @T.prim_func
        def attention(q_h: T.handle, kc_h: T.handle, vc_h: T.handle, pos: T.int64, layer: T.int64, o_h: T.handle):
            T.func_attr({"tirx.noalias": True})
            n, C = T.int64(), T.int64()
            q = T.match_buffer(q_h, (n, H * hd), "float32")  # [T, n_heads * head_dim], rotated
            kc = T.match_buffer(kc_h, (L, Hkv, C, hd), dt)  # [n_layers, n_kv_heads, ctx, head_dim]
            vc = T.match_buffer(vc_h, (L, Hkv, C, hd), dt)
            o = T.match_buffer(o_h, (n, H * hd), "float32")
            for task in T.parallel(n * H):
                acc = T.alloc_buffer((hd,), "float32")  # sum_j p_j v_j
                s = T.alloc_buffer((B,), "float32")  # scores, then probabilities, of one key block
                st = T.alloc_buffer((3,), "float32")  # running max, running sum, block max
                # Row r = task // H in zig-zag order (0, n-1, 1, n-2, ...): the contiguous task range each
                # thread gets mixes short and long rows, so causal prefill work stays balanced.
                r: T.let[T.int64] = task // H
                t: T.let[T.int64] = T.Select(r % 2 == 0, r // 2, n - 1 - r // 2)
                h: T.let[T.int64] = task % H
                kvh: T.let[T.int64] = h // G
                n_ctx: T.let[T.int64] = pos + t + 1
                for d in T.vectorized(hd):
                    acc[d] = T.float32(0)
                st[0] = T.float32(NEG)
                st[1] = T.float32(0)
                for jb in range((n_ctx + B - 1) // B):
                    nb: T.let[T.int64] = T.min(T.int64(B), n_ctx - jb * B)
                    st[2] = st[0]
                    for j in range(T.int64(B)):
                        if j < nb:
                            s[j] = dot(q, kc, t, h, layer, kvh, jb * B + j) * T.float32(scale)
                            st[2] = T.max(st[2], s[j])
                        else:
                            s[j] = T.float32(NEG)
                    corr: T.let[T.float32] = exp_f32(st[0] - st[2])
                    for j in T.vectorized(T.int64(B)):
                        s[j] = exp_f32(s[j] - st[2])
                    st[1] = st[1] * corr
                    for d in T.vectorized(hd):
                        acc[d] = acc[d] * corr
                    for j in range(nb):
                        st[1] = st[1] + s[j]
                        for d in T.vectorized(hd):
                            acc[d] = acc[d] + s[j] * T.Cast("float32", vc[layer, kvh, jb * B + j, d])
                    st[0] = st[2]
                for d in T.vectorized(hd):
                    o[t, h * hd + d] = acc[d] / st[1]

        return attention
