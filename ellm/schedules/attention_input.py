"""The fused attention input: q, k, v = RMSNorm(x) @ Wqkv (+ bias); rotate q and k; append k and v to the
cache; emit rotated q. One kernel, one task per head: the task's 64 (head_dim) output rows are in
registers when RoPE is applied, so q, k and v never exist unrotated in memory.

Adjacent-pair RoPE (llama GGUF) rotates lanes (2i, 2i+1) of one vector: a lane swap and a sign vector.
NeoX RoPE (qwen2) rotates lane i of vector j with lane i of vector j + rope_dim/32.
"""

from __future__ import annotations

from typing import Mapping

from tvm import tirx
from tvm.script.ir_builder import IRBuilder
from tvm.tirx.script.builder import ir as I

from ..compiler.graph import OpKind
from ..quant.tiled import TILED_COMPONENTS
from ..targets import TargetPreset
from .attention import kv_plan_of
from .kv_blocks import KVBuffers
from .rule import KernelRequest, Knob, Rule
from .space import Constraint
from .int_acts import L, Acts, quantize_row
from .int_acts import ramp as _ramp
from .int_kernel import (PREFETCH_LOCALITY, QUANTIZED, Rows, default_locality, for_token_tiles, micro_kernel, tile_rows,
                         without_moot_locality)
from .intdot import Dot, dot_for
from .node_tasks import NodeTasks

HALF = L // 2  # rows of a half tile: one ymm register of float32 sums
SWAP = [i ^ 1 for i in range(L)]  # lane 2i <-> 2i + 1
DUP = [i // 2 for i in range(L)]  # lane 2i, 2i + 1 <- element i


def _rotate(vecs: list, tab, p, half: int, neox: bool, rope_dim: int) -> list:
    """RoPE on one head given as head_dim/16 vectors, at position p."""
    out = list(vecs)
    if neox:
        for j in range(half // L):
            c, s = tab[p, _ramp(j * L)], tab[p, _ramp(half + j * L)]
            lo, hi = vecs[j], vecs[j + half // L]
            out[j] = lo * c - hi * s
            out[j + half // L] = lo * s + hi * c
        return out
    minus, plus = tirx.Broadcast(tirx.const(-1.0, "float32"), L), tirx.Broadcast(tirx.const(1.0, "float32"), L)
    sign = tirx.Shuffle([minus, plus], [i + L * (i % 2) for i in range(L)])  # -1 on even lanes, +1 on odd
    for j in range(rope_dim // L):
        c8, s8 = tab[p, tirx.Ramp(j * 8, 1, 8)], tab[p, tirx.Ramp(half + j * 8, 1, 8)]
        c, s = tirx.Shuffle([c8, c8], DUP), tirx.Shuffle([s8, s8], DUP)
        out[j] = vecs[j] * c + tirx.Shuffle([vecs[j], vecs[j]], SWAP) * s * sign
    return out


def passes_fit(hd: int, passes: int) -> bool:
    """Whether `passes` split a head into equal runs of whole half tiles."""
    return hd % passes == 0 and (hd // passes) % HALF == 0


def build_attention_input(req: KernelRequest, dot: Dot, tokens_per_tile: int, prefetch_bytes: int, prefetch_locality: int = 0,
                          passes: int = 1):
    """`passes`: passes over the inputs per head, each accumulating head_dim / passes rows (a head's 64 or 128
    rows at once need more registers than 256-bit classes have: they spill in the inner loop)."""
    plan, kt, vt = kv_plan_of(req)
    Hkv, hd = plan.n_kv_heads, plan.head_dim
    H = int(req.attr("n_heads"))
    rope_dim, neox = int(req.attr("rope_dim")), bool(req.attr("neox"))
    half = rope_dim // 2
    qtype = req.qtype
    N, K = req.weight_shape  # (H + 2 Hkv) * hd rows: [q | k | v]
    bits = int(req.attr("act_bits", 8))
    nv = hd // L  # vectors per head
    assert passes_fit(hd, passes), (hd, passes)
    rows_per_pass = hd // passes
    lanes = L if rows_per_pass % L == 0 else HALF  # whole row tiles, or half tiles
    with IRBuilder() as ib:
        with I.prim_func():
            I.func_name("attention_input")
            I.func_attr({"tirx.noalias": True})
            n_tok = req.m if req.m is not None else tirx.Var("T", "int64")
            kv = KVBuffers.declare(plan, kt, vt)
            x = I.arg("x", I.buffer((n_tok, K), "float32"))
            w = {c.name: I.arg(f"w_{c.name}", I.buffer(c.shape(N, K), c.dtype)) for c in TILED_COMPONENTS[qtype]}
            gain = I.arg("norm", I.buffer((K,), "float32"))
            bias = I.arg("bias", I.buffer((N,), "float32")) if "bias" in req.vectors else None
            tab = I.arg("rope", I.buffer((tirx.Var("C", "int64"), rope_dim), "float32"))
            pos, layer, kslot, vslot = KVBuffers.step_args()
            q_out = I.arg("q", I.buffer((n_tok, H * hd), "float32"))
            acts = Acts.alloc(n_tok, K, bits)
            with (I.serial if req.m == 1 else I.parallel)(0, n_tok) as t:
                quantize_row(x, t, gain, float(req.attr("norm_eps")), K, acts, t)

            def per_head(head):  # one head's rows: q heads, then k, then v
                tiles = [head * nv + j for j in range(nv)]

                def project(t0, tt):
                    def finish(accs):
                        for i in range(tt):
                            t = t0 + i
                            p = pos + t
                            vecs = list(accs[i])
                            if bias is not None:
                                vecs = [v + bias[_ramp((head * nv + j) * L)] for j, v in enumerate(vecs)]
                            vecs = [I.Bind(v) for v in vecs]
                            rot = [I.Bind(v) for v in _rotate(vecs, tab, p, half, neox, rope_dim)]
                            with I.If(head < H):
                                with I.Then():
                                    for j in range(nv):
                                        I.buffer_store(q_out, rot[j], [t, _ramp(head * hd + j * L)])
                                with I.Else():
                                    with I.If(head < H + Hkv):
                                        with I.Then():
                                            kv.write_k(layer, head - H, p, rot)
                                        with I.Else():
                                            kv.write_v(layer, head - H - Hkv, p, vecs)

                    if passes == 1:
                        micro_kernel(dot, qtype, w, tile_rows(tiles), t0, tt, K, acts, None, prefetch_bytes, prefetch_locality,
                                     finish=finish)
                        return
                    # the head's rows in passes, gathered here before rotation: [tt, head_dim]
                    rows = I.alloc_buffer((tt, hd), "float32")
                    slots = tile_rows(tiles, lanes)
                    per_pass = rows_per_pass // lanes

                    column = {id(r): j * lanes for j, r in enumerate(slots)}

                    def gather(t, r: Rows, acc):
                        I.buffer_store(rows, acc, [t - t0, tirx.Ramp(column[id(r)], 1, lanes)])

                    for first in range(0, len(slots), per_pass):
                        micro_kernel(dot, qtype, w, slots[first:first + per_pass], t0, tt, K, acts, gather,
                                     prefetch_bytes, prefetch_locality)
                    finish([[rows[i, _ramp(j * L)] for j in range(nv)] for i in range(tt)])

                for_token_tiles(req.m, n_tok, tokens_per_tile, project)
                # blocks this step completed age out of the ring into their store (this head's task wrote them)
                first, count = kv.completed_blocks(pos, n_tok)
                with I.If(head >= H):
                    with I.Then():
                        with I.serial(0, count) as i:
                            with I.If(head < H + Hkv):
                                with I.Then():
                                    kv.store_k_block(layer, kslot, head - H, first + i)
                                with I.Else():
                                    kv.store_v_block(layer, vslot, head - H - Hkv, first + i)

            nodes = NodeTasks.of(req)
            if nodes is None:
                with I.parallel(0, H + 2 * Hkv) as head:
                    per_head(head)
            else:  # the NUMA plan's tasks: a node's query heads and its KV heads' k and v, shared by its threads
                def planned(task, ranges):
                    for lo, hi in ranges:
                        with I.serial(lo, hi) as head:
                            per_head(head)

                nodes.scaled(nv).loop(planned, "int32")
    return ib.get()


class AttentionInputRule(Rule):
    name = "attention_input"
    follows_numa_tasks = True
    knobs = (Knob("prefetch_bytes", 4096, (0, 2048, 4096, 8192), "software prefetch distance in the weight stream"),
             PREFETCH_LOCALITY,
             Knob("tokens_per_tile", 2, (1, 2, 4), "tokens sharing each unpacked weight vector (chunks)"),
             Knob("passes", 1, (1, 2, 4, 8), "passes over the inputs per head, each for head_dim / passes rows"))

    def applies(self, req: KernelRequest, target: TargetPreset) -> bool:
        if req.kind is not OpKind.ATTN_INPUT or dot_for(target) is None or req.qtype not in QUANTIZED:
            return False
        if req.attr("kv_plan") is None:
            return False
        hd = kv_plan_of(req)[0].head_dim
        rope_dim, neox = int(req.attr("rope_dim")), bool(req.attr("neox"))
        return hd % L == 0 and (rope_dim // 2) % L == 0 if neox else rope_dim % L == 0

    def default_knobs(self, req: KernelRequest, target: TargetPreset) -> dict[str, int]:
        knobs = super().default_knobs(req, target)
        if req.m == 1:
            knobs["tokens_per_tile"] = 1
        # 256-bit registers: one row tile per pass (a head at once spills its sums in the inner loop: 26 vs
        # 19 us for SmolLM2's 960x576 on one Emerald Rapids core, x86-64-v3); 512-bit ones hold a head
        if dot_for(target).width == 256:
            knobs["passes"] = min(kv_plan_of(req)[0].head_dim // L, 8)
        knobs["prefetch_locality"] = default_locality(target)
        return knobs

    def canonical(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]) -> dict[str, int]:
        return without_moot_locality(knobs, target)

    def active_knobs(self, req: KernelRequest, target: TargetPreset) -> tuple[Knob, ...]:
        # one token: every token tile is that token, whatever its size
        return tuple(k for k in self.knobs if not (req.m == 1 and k.name == "tokens_per_tile"))

    def constraints(self, req: KernelRequest, target: TargetPreset) -> tuple[Constraint, ...]:
        hd = kv_plan_of(req)[0].head_dim
        return (Constraint(f"passes split head_dim {hd} into runs of whole half tiles ({HALF} rows)",
                           lambda p: passes_fit(hd, p["passes"])),)

    def build(self, req: KernelRequest, target: TargetPreset, knobs: Mapping[str, int]):
        return build_attention_input(req, dot_for(target), knobs["tokens_per_tile"], knobs["prefetch_bytes"],
                                     knobs["prefetch_locality"], knobs["passes"])
