"""Causal GQA attention over the KV cache, 16 keys at a time.

K is stored transposed in blocks of 16 keys, [n_layers, n_kv_heads, ctx/16, head_dim, 16], so the
scores of 16 keys are one vector: sum over d of q[d] * K[block, d, :], no horizontal sums. V stays
[n_layers, n_kv_heads, ctx, head_dim]. One task serves all G query heads of a KV head (every K and V
vector is loaded and converted once for G heads) and `queries` query tokens, with an online softmax
per 16-key block. Single-token decode also splits the keys into chunks across threads (split-K) and
merges the partial softmax results, so long contexts stream at memory speed on every core.
Query t of a step sits at position pos + t and sees cache positions 0..pos+t.
"""

from __future__ import annotations

import math
from typing import Mapping

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script.builder import ir as I

from ..compiler.graph import OpKind
from ..targets import TargetPreset
from .rule import KernelRequest, Knob, Rule
from .vecmath import exp_f32, hmax, hsum

KB = 16  # keys per K block = vector lanes
F32 = f"float32x{KB}"
NEG = -3.0e38


def _ramp(base, n=KB):
    return tirx.Ramp(base, 1, n)


def _bc(v, n=KB):
    return tirx.Broadcast(v, n)


def _f32(v):
    return tirx.const(v, "float32")


def cache_shapes(cache_t, k_block: int = KB):
    """(K shape, V shape) with symbolic block count and context: see the module docstring."""
    L, Hkv, _, hd = cache_t.shape
    cb, c = tirx.Var("CB", "int64"), tirx.Var("C", "int64")
    return (L, Hkv, cb, hd, k_block), (L, Hkv, c, hd)


def cache_args(cache_t):
    """Declare the K and V cache kernel arguments (in this order), in the layout of cache_shapes."""
    k_shape, v_shape = cache_shapes(cache_t)
    return I.arg("k_cache", I.buffer(k_shape, cache_t.dtype)), I.arg("v_cache", I.buffer(v_shape, cache_t.dtype))


class _State:
    """Online-softmax state of one (query, head): small separate stack buffers, so LLVM keeps them in
    registers (TVM puts buffers over 1 KiB on the heap, where every update becomes a store)."""

    def __init__(self, hd: int):
        self.m = I.alloc_buffer((1,), "float32")  # running max
        self.l = I.alloc_buffer((1,), "float32")  # running sum
        self.acc = I.alloc_buffer((hd,), "float32")  # sum_j p_j v_j
        self.s = I.alloc_buffer((KB,), "float32")  # scores of the current block
        self.p = I.alloc_buffer((KB,), "float32")  # their probabilities
        I.buffer_store(self.m, _f32(NEG), [0])
        I.buffer_store(self.l, _f32(0.0), [0])
        for c in range(hd // KB):
            I.buffer_store(self.acc, _bc(_f32(0.0)), [_ramp(c * KB)])


def _attend_range(q, kc, vc, layer, kvh, queries, G: int, hd: int, b0, b1, scale: float, states) -> None:
    """Online softmax over key blocks [b0, b1) for `queries`: list of (row t, n_ctx) sharing KV head kvh.

    states[i * G + g] is the _State of query i and head g.
    """
    nq = len(queries)
    with I.serial(b0, b1) as b:
        for st in states:
            I.buffer_store(st.s, _bc(_f32(0.0)), [_ramp(0)])
        with I.serial(0, hd) as d:
            kv = I.Bind(tirx.Cast(F32, kc[layer, kvh, b, d, _ramp(0)]))
            for i, (t, _) in enumerate(queries):
                for g in range(G):
                    st = states[i * G + g]
                    qd = q[t, (kvh * G + g) * hd + d]
                    I.buffer_store(st.s, st.s[_ramp(0)] + _bc(qd) * kv, [_ramp(0)])
        n_valid = []
        for i, (t, n_ctx) in enumerate(queries):
            valid = _ramp(b * KB) < _bc(n_ctx)
            n_valid.append(tirx.min(tirx.IntImm("int64", KB), n_ctx - b * KB))
            for g in range(G):
                st = states[i * G + g]
                sc = I.Bind(tirx.Select(valid, st.s[_ramp(0)] * _bc(_f32(scale)), _bc(_f32(NEG))))
                m_old = st.m[0]
                m_new = I.Bind(tirx.max(m_old, hmax(sc)))
                corr = I.Bind(exp_f32(m_old - m_new))
                p = I.Bind(exp_f32(sc - _bc(m_new)))
                I.buffer_store(st.p, p, [_ramp(0)])
                I.buffer_store(st.l, st.l[0] * corr + hsum(p), [0])
                I.buffer_store(st.m, m_new, [0])
                for c in range(hd // KB):
                    I.buffer_store(st.acc, st.acc[_ramp(c * KB)] * _bc(corr), [_ramp(c * KB)])
        # V: only rows that exist (beyond n_ctx the cache holds stale or uninitialised values)
        with I.serial(0, tirx.max(*n_valid) if nq > 1 else n_valid[0]) as jj:
            vrow = [I.Bind(tirx.Cast(F32, vc[layer, kvh, b * KB + jj, _ramp(c * KB)])) for c in range(hd // KB)]
            for st in states:
                pj = st.p[jj]
                for c in range(hd // KB):
                    a = _ramp(c * KB)
                    I.buffer_store(st.acc, st.acc[a] + _bc(pj) * vrow[c], [a])


def build_attention(req: KernelRequest, queries: int, chunk: int):
    """`queries` query tokens per task; `chunk` > 0 splits the keys of single-token steps into chunks."""
    q_t, cache_t = req.in_types
    L, Hkv, _, hd = cache_t.shape
    H = int(req.attr("n_heads"))
    G = H // Hkv
    scale = 1.0 / math.sqrt(hd)
    with IRBuilder() as ib:
        with I.prim_func():
            I.func_name("attention")
            I.func_attr({"tirx.noalias": True})
            n = req.m if req.m is not None else tirx.Var("T", "int64")
            q = I.arg("q", I.buffer((n, H * hd), "float32"))  # [T, n_heads * head_dim], rotated
            kc, vc = cache_args(cache_t)
            pos = I.arg("pos", tirx.Var("pos", "int64"))
            layer = I.arg("layer", tirx.Var("layer", "int64"))
            out = I.arg("out", I.buffer((n, H * hd), "float32"))
            if req.m == 1 and chunk:
                _decode_split_k(q, kc, vc, pos, layer, out, Hkv, G, hd, scale, chunk)
            else:
                _prefill(q, kc, vc, pos, layer, out, n, Hkv, G, hd, scale, queries)
    return ib.get()


def _prefill(q, kc, vc, pos, layer, out, n, Hkv: int, G: int, hd: int, scale: float, nq: int) -> None:
    """Tasks = (tile of nq query rows, KV head); tiles in zig-zag order (0, last, 1, last-1, ...) so each
    thread's contiguous share of tasks mixes short and long causal rows."""
    tiles = (n + nq - 1) // nq
    with I.parallel(0, tiles * Hkv) as task:
        r = task // Hkv
        kvh = task % Hkv
        tile = I.Bind(tirx.Select(r % 2 == 0, r // 2, tiles - 1 - r // 2))
        states = [_State(hd) for _ in range(nq * G)]
        rows = [I.Bind(tirx.min(tile * nq + i, n - 1)) for i in range(nq)]  # a short last tile repeats row n-1
        queries = [(t, pos + t + 1) for t in rows]
        _attend_range(q, kc, vc, layer, kvh, queries, G, hd, 0, (pos + rows[-1] + KB) // KB, scale, states)
        for i, t in enumerate(rows):
            for g in range(G):
                st = states[i * G + g]
                inv = I.Bind(_f32(1.0) / st.l[0])
                for c in range(hd // KB):
                    I.buffer_store(out, st.acc[_ramp(c * KB)] * _bc(inv), [t, _ramp((kvh * G + g) * hd + c * KB)])


def _decode_split_k(q, kc, vc, pos, layer, out, Hkv: int, G: int, hd: int, scale: float, chunk: int) -> None:
    """One query token: tasks = (KV head, chunk of keys) write partial (max, sum, acc); a second parallel
    loop merges them per head."""
    n_ctx = pos + 1
    blocks_per_chunk = chunk // KB
    n_chunks = I.Bind((n_ctx + chunk - 1) // chunk)
    part_st = I.alloc_buffer((Hkv * n_chunks * G * 2,), "float32")
    part_acc = I.alloc_buffer((Hkv * n_chunks * G * hd,), "float32")
    with I.parallel(0, Hkv * n_chunks) as task:
        kvh = task // n_chunks
        c = task % n_chunks
        states = [_State(hd) for _ in range(G)]
        b0 = c * blocks_per_chunk
        b1 = tirx.min(b0 + blocks_per_chunk, (n_ctx + KB - 1) // KB)
        _attend_range(q, kc, vc, layer, kvh, [(0, n_ctx)], G, hd, b0, b1, scale, states)
        for g, st in enumerate(states):
            I.buffer_store(part_st, st.m[0], [(task * G + g) * 2])
            I.buffer_store(part_st, st.l[0], [(task * G + g) * 2 + 1])
            for cc in range(hd // KB):
                I.buffer_store(part_acc, st.acc[_ramp(cc * KB)], [_ramp((task * G + g) * hd + cc * KB)])
    with I.parallel(0, Hkv * G) as h:
        kvh, g = h // G, h % G
        tot = I.alloc_buffer((2,), "float32")  # max, sum
        o = I.alloc_buffer((hd,), "float32")
        I.buffer_store(tot, _f32(NEG), [0])
        I.buffer_store(tot, _f32(0.0), [1])
        for cc in range(hd // KB):
            I.buffer_store(o, _bc(_f32(0.0)), [_ramp(cc * KB)])
        with I.serial(0, n_chunks) as c:
            I.buffer_store(tot, tirx.max(tot[0], part_st[((kvh * n_chunks + c) * G + g) * 2]), [0])
        with I.serial(0, n_chunks) as c:
            base = (kvh * n_chunks + c) * G + g
            w = I.Bind(exp_f32(part_st[base * 2] - tot[0]))
            I.buffer_store(tot, tot[1] + part_st[base * 2 + 1] * w, [1])
            for cc in range(hd // KB):
                I.buffer_store(o, o[_ramp(cc * KB)] + part_acc[_ramp(base * hd + cc * KB)] * _bc(w), [_ramp(cc * KB)])
        inv = I.Bind(_f32(1.0) / tot[1])
        for cc in range(hd // KB):
            I.buffer_store(out, o[_ramp(cc * KB)] * _bc(inv), [0, _ramp(h * hd + cc * KB)])


def _applies(req: KernelRequest) -> bool:
    hd = req.in_types[1].shape[-1]
    return req.kind is OpKind.ATTENTION and req.in_cols == (None, None) and hd % KB == 0


class AttentionDecodeRule(Rule):
    """One token: split-K over (KV head, key chunk) tasks, then a merge."""

    name = "attention_decode"
    knobs = (Knob("chunk", 256, (128, 256, 512, 1024, 2048), "keys per split-K task"),)

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return req.m == 1 and _applies(req)

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        return build_attention(req, 1, knobs["chunk"])


class AttentionPrefillRule(Rule):
    """A chunk of tokens: tasks over (query tile, KV head), causal."""

    name = "attention"
    knobs = (Knob("queries", 2, (1, 2, 3), "query tokens per task sharing each K/V load"),)

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        return req.m != 1 and _applies(req)

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        return build_attention(req, knobs["queries"], 0)
