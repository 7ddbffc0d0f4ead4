"""The block KV cache inside kernels: declaring its buffers, writing tokens into the ring, quantising a
block when it completes, and reading a block (16 keys at a time) for attention.

Layouts are kv/plan.py's. A query at position t reads block b from the ring (float16) when
b > t // B - recent, else from its class's store; both paths are emitted and chosen per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import tirx
from tvm.tirx.script.builder import ir as I

from ..kv.plan import KVPlan, KVType
from .intdot import Dot
from .vecmath import hadamard, hmax, hreduce

L = 16  # lanes: keys per score vector, channels per value vector
F32 = f"float32x{L}"


def ramp(base, n=L):
    """Lanes base .. base + n - 1 (a vector index)."""
    return tirx.Ramp(base, 1, n)


def bc(v, n=L):
    """`v` broadcast to n lanes."""
    return tirx.Broadcast(v, n)


def f32(v):
    return tirx.const(v, "float32")


def hmin(v):
    return hreduce(v, tirx.min)


@dataclass
class KVBuffers:
    """The KV buffers of one (K type, V type) layer class, declared as kernel arguments."""

    plan: KVPlan
    kt: KVType
    vt: KVType
    ring_k: object  # [L, Hkv, RS, B/16, hd, 16]
    ring_v: object  # [L, Hkv, RS, B, hd]
    k_store: object
    k_side: object  # summary (float types) or params (quantised)
    v_store: object
    v_params: object | None
    nb: object = None  # the symbolic number of blocks in the stores
    dot: Dot | None = None  # the target's integer dot products (schedules/intdot.py), for the two below
    int_scores: bool = False  # score quantised key blocks in int32 (the query rounded to int_bits bits)
    int_values: bool = False  # sum quantised value blocks in int32 (the weights rounded to int_bits bits)
    int_bits: int = 16  # 16 (two int8 halves: float32-like) or 8 (half the dot products)

    @classmethod
    def declare(cls, plan: KVPlan, kt: KVType, vt: KVType, dot: Dot | None = None, int_scores: bool = False,
                int_values: bool = False, int_bits: int = 16) -> KVBuffers:
        """The buffers of a layer whose K and V classes are kt and vt, in KVPlan.layer_tensors order."""
        if int_bits not in (8, 16):
            raise ValueError(f"integer attention rounds to 8 or 16 bits, not {int_bits}")
        nb = tirx.Var("NB", "int64")
        args = [I.arg(st.name, I.buffer(tuple(nb if d == "NB" else d for d in st.shape), st.dtype))
                for st in plan.layer_tensors(kt, vt)]
        ring_k, ring_v, k_store, k_side, v_store, *v_params = args
        return cls(plan, kt, vt, ring_k, ring_v, k_store, k_side, v_store, v_params[0] if v_params else None, nb,
                   dot, dot is not None and int_scores and not kt.is_float, dot is not None and int_values and not vt.is_float,
                   int_bits)

    @property
    def query_bits(self) -> int:
        """Bits of the rounded query (0: scores in float)."""
        return self.int_bits if self.int_scores else 0

    @staticmethod
    def step_args():
        """The scalar arguments of every cache kernel, after its buffers: (pos, layer, kslot, vslot) = the
        step's first position, the layer, and the layer's index in its K and V storage classes."""
        return tuple(I.arg(name, tirx.Var(name, "int64")) for name in ("pos", "layer", "kslot", "vslot"))

    @property
    def block(self) -> int:
        return self.plan.block

    @property
    def rotated(self) -> bool:
        """Keys (and the queries scoring them) live rotated by the head's Hadamard transform (kv/plan.py)."""
        return self.plan.rotates(self.kt)

    def ring_slot(self, b):
        """kv/plan.py's KVPlan.ring_slot: pinned blocks keep slots 0 .. pinned - 1, the others cycle."""
        P, RS = self.plan.pinned, self.plan.ring
        if not P:
            return b % RS
        return tirx.Select(b < P, b, P + (b - P) % (RS - P))

    def in_ring(self, b, first_ring):
        """Whether a query whose recent tier starts at block first_ring reads block b from the ring."""
        return b >= first_ring if not self.plan.pinned else tirx.any(b >= first_ring, b < self.plan.pinned)

    def prefetch_block(self, kslot, vslot, h, b, locality: int = 2) -> None:
        """Software prefetch (LLVM locality: 2, prefetcht1, into L2, by default; t0 measured no gain) of stored
        block b of head h: its key codes and params, its value codes and params. A decode step reads blocks
        scattered over the store, where the hardware prefetchers only start after the first misses of each;
        prefetches never fault."""
        for buf, idx in ((self.k_store, (kslot, h, b)), (self.k_side, (kslot, h, b)), (self.v_store, (vslot, h, b)),
                         (self.v_params, (vslot, h, b))):
            if buf is None:
                continue
            per_block = 1
            for d in buf.shape[3:]:
                per_block *= int(d)
            item = tvm.DataType(buf.dtype).bits // 8
            zeros = [0] * (len(buf.shape) - 4)
            for line in range(0, per_block * item, 64):
                addr = tirx.address_of(tirx.BufferLoad(buf, [*idx, *zeros, tirx.IntImm("int64", line // item)]))
                I.evaluate(tirx.call_llvm_intrin("void", "llvm.prefetch.p0", addr, 0, locality, 1))

    # --- writing -------------------------------------------------------------------------
    def write_k(self, layer, h, p, vecs) -> None:
        """Key of the token at position p (head_dim / 16 float32 vectors) into the ring, transposed (and
        rotated, in a rotated layer)."""
        B, dt = self.block, self.plan.ring_dtype
        if self.rotated:
            vecs = [I.Bind(v) for v in hadamard(vecs)]
        slot = self.ring_slot(p // B)
        for j, v in enumerate(vecs):
            kv = tirx.Cast(f"{dt}x{L}", v)
            for lane in range(L):
                I.buffer_store(self.ring_k, tirx.Shuffle([kv], [lane]), [layer, h, slot, (p % B) // L, j * L + lane, p % L])

    def write_k_values(self, layer, h, p, value_of) -> None:
        """write_k of a key given channel by channel: value_of(d) for d in 0 .. head_dim - 1 (Python ints)."""
        hd = self.plan.head_dim
        row = I.alloc_buffer((hd,), "float32")
        for d in range(hd):
            I.buffer_store(row, value_of(d), [d])
        self.write_k(layer, h, p, [row[ramp(j * L)] for j in range(hd // L)])

    def write_v(self, layer, h, p, vecs) -> None:
        B, dt = self.block, self.plan.ring_dtype
        for j, v in enumerate(vecs):
            I.buffer_store(self.ring_v, tirx.Cast(f"{dt}x{L}", v), [layer, h, self.ring_slot(p // B), p % B, ramp(j * L)])

    def write_v_scalar(self, layer, h, p, d, value) -> None:
        B = self.block
        I.buffer_store(self.ring_v, tirx.Cast(self.plan.ring_dtype, value), [layer, h, self.ring_slot(p // B), p % B, d])

    # --- ageing: quantise a completed block ------------------------------------------------
    def completed_blocks(self, pos, n_tok):
        """(first, count) of the blocks whose last token is among positions pos .. pos + n_tok - 1."""
        B = self.block
        return pos // B, (pos + n_tok) // B - pos // B

    def store_k_block(self, layer, kslot, h, b) -> None:
        """Ring block b of (layer, head h) -> the K store at block b: copy + summary, or quantise.
        Rows are channels: channel d's B keys are element d of every 16-key tile."""
        B, hd = self.block, self.plan.head_dim
        src = (layer, h, self.ring_slot(b))
        with I.serial(0, hd) as d:
            xs = [I.Bind(tirx.Cast(F32, self.ring_k[(*src, c, d, ramp(0))])) for c in range(B // L)]
            if self.kt is KVType.Q4:  # tile pair j: tile 2j low nibbles, 2j + 1 high
                dst = [((kslot, h, b, c // 2, d), c % 2) for c in range(B // L)]
            else:
                dst = [((kslot, h, b, c, d), 0) for c in range(B // L)]
            _store_row(xs, self.kt, self.k_store, dst, self.k_side, (kslot, h, b), d)

    def store_v_block(self, layer, vslot, h, b) -> None:
        """Ring block b -> the V store; float types copy rows (tokens), quantised types quantise each token
        and interleave 4 tokens' codes per channel (kv/plan.py's layout) from one group of tokens at a time."""
        B, hd = self.block, self.plan.head_dim

        def row(j):
            slot = self.ring_slot(b)
            return [I.Bind(tirx.Cast(F32, self.ring_v[layer, h, slot, j, ramp(c * L)])) for c in range(hd // L)]

        if self.vt.is_float:
            with I.serial(0, B) as j:
                for c, x in enumerate(row(j)):
                    I.buffer_store(self.v_store, tirx.Cast(f"{self.vt.dtype}x{L}", x), [vslot, h, b, j, ramp(c * L)])
            return
        per = 4 if self.vt is KVType.Q8 else 8  # tokens per 64-byte group
        codes = I.alloc_buffer((per * hd,), "uint8")  # [token of the group, channel]
        with I.serial(0, B // per) as m:
            with I.serial(0, per) as k:
                j = m * per + k
                mn, sc, cs = _quantise(row(j), self.vt)
                I.buffer_store(self.v_params, mn, [vslot, h, b, 0, j])
                I.buffer_store(self.v_params, sc, [vslot, h, b, 1, j])
                for c, code in enumerate(cs):
                    I.buffer_store(codes, code, [ramp(k * hd + c * L)])
            for c in range(hd // L):
                group = tirx.Shuffle([codes[ramp(k * hd + c * L)] for k in range(4)], _TRANSPOSE_4x16)
                if per == 8:
                    high = tirx.Shuffle([codes[ramp((4 + k) * hd + c * L)] for k in range(4)], _TRANSPOSE_4x16)
                    group = group | (high << tirx.Broadcast(tirx.const(4, "uint8"), 64))
                I.buffer_store(self.v_store, group, [vslot, h, b, c, m, tirx.Ramp(0, 1, 64)])


def _quantise(xs, t: KVType):
    """Asymmetric codes of one row of 16-lane vectors `xs`: (min, scale) in float16 and uint8x16 codes
    round((x - min) / scale) in [0, qmax], computed with the rounded min and scale, so every dequantised
    value min + scale * code lies in [min, min + scale * qmax]."""
    lo_v, hi_v = xs[0], xs[0]
    for x in xs[1:]:
        lo_v, hi_v = tirx.min(lo_v, x), tirx.max(hi_v, x)
    lo, hi = I.Bind(hmin(lo_v)), I.Bind(hmax(hi_v))
    mn = I.Bind(tirx.Cast("float32", tirx.Cast("float16", lo)))
    sc16 = I.Bind(tirx.Cast("float16", (hi - mn) / f32(float(t.qmax))))
    sc = I.Bind(tirx.Cast("float32", sc16))
    inv = I.Bind(tirx.Select(sc > f32(0.0), f32(1.0) / sc, f32(0.0)))
    codes = []
    for x in xs:
        q = tirx.floor((x - bc(mn)) * bc(inv) + bc(f32(0.5)))
        q = tirx.max(tirx.min(q, bc(f32(float(t.qmax)))), bc(f32(0.0)))
        codes.append(I.Bind(tirx.Cast(f"uint8x{L}", tirx.Cast(f"int32x{L}", q))))
    return tirx.Cast("float16", mn), sc16, codes


def _store_row(xs, t: KVType, dst, places, side, side_idx, r) -> None:
    """One K channel row (16-lane vectors `xs` over the block's keys) into the store; places[c] = (index
    prefix, nibble) of vector c. Float types copy and record the row's (min, max) as the block summary;
    quantised types record (min, scale) (see _quantise)."""
    if t.is_float:
        lo_v, hi_v = xs[0], xs[0]
        for x in xs[1:]:
            lo_v, hi_v = tirx.min(lo_v, x), tirx.max(hi_v, x)
        for (prefix, _), x in zip(places, xs):
            I.buffer_store(dst, tirx.Cast(f"{t.dtype}x{L}", x), [*prefix, ramp(0)])
        I.buffer_store(side, tirx.Cast(side.dtype, hmin(lo_v)), [*side_idx, 0, r])
        I.buffer_store(side, tirx.Cast(side.dtype, hmax(hi_v)), [*side_idx, 1, r])
        return
    mn, sc, codes = _quantise(xs, t)
    I.buffer_store(side, mn, [*side_idx, 0, r])
    I.buffer_store(side, sc, [*side_idx, 1, r])
    if t is KVType.Q8:
        for (prefix, _), code in zip(places, codes):
            I.buffer_store(dst, code, [*prefix, ramp(0)])
        return
    pairs: dict[str, list] = {}
    for (prefix, nib), code in zip(places, codes):  # the low and high nibble of each byte vector
        pairs.setdefault(str(prefix), [prefix, None, None])[1 + nib] = code
    for prefix, low, high in pairs.values():
        I.buffer_store(dst, low | (high << bc(tirx.const(4, "uint8"))), [*prefix, ramp(0)])


# --- reading -----------------------------------------------------------------------------
def k_codes_f32(store, idx, t: KVType, tile):
    """float32x16 of the codes of 16-key tile `tile` at channel row idx = (slot, head, block, ..., d)."""
    slot, h, b, d = idx
    if t is KVType.Q8:
        return tirx.Cast(F32, store[slot, h, b, tile, d, ramp(0)])
    byte = store[slot, h, b, tile // 2, d, ramp(0)]
    return _nibbles(byte, tile % 2)


def v_group_u8(store, idx, t: KVType, c, g):
    """uint8x64 codes of channels 16c .. 16c+15 for the 4 keys 4g .. 4g+3 of a stored V block
    idx = (slot, head, block): byte 4i + k = channel 16c + i of key 4g + k."""
    if t is KVType.Q8:
        return store[(*idx, c, g, tirx.Ramp(0, 1, 64))]
    return nibbles_u8x64(store[(*idx, c, g // 2, tirx.Ramp(0, 1, 64))], g % 2)


def v_codes_f32(group, k: int):
    """float32x16 of key k's codes (k < 4) picked out of a group from v_group_u8 (the float path)."""
    return tirx.Cast(F32, tirx.Shuffle([group], [4 * i + k for i in range(L)]))


def nibbles_u8x64(raw, high):
    """The low (high = 0) or high nibble of each of 64 bytes, as bytes; `high` may be a loop expression."""
    if isinstance(high, int):
        if high:
            return raw >> tirx.Broadcast(tirx.const(4, "uint8"), 64)
        return raw & tirx.Broadcast(tirx.const(15, "uint8"), 64)
    shift = tirx.Broadcast(tirx.Cast("uint8", high * 4), 64)
    return (raw >> shift) & tirx.Broadcast(tirx.const(15, "uint8"), 64)


def _nibbles(byte, high):
    """The low (high = 0) or high nibble of 16 bytes as float32x16; `high` may be a loop expression."""
    wide = tirx.Cast(f"int32x{L}", byte)
    if isinstance(high, int):
        return tirx.Cast(F32, (wide >> bc(tirx.const(4 * high, "int32"))) & bc(tirx.const(15, "int32")))
    shift = tirx.Cast("int32", high * 4)
    return tirx.Cast(F32, (wide >> bc(shift)) & bc(tirx.const(15, "int32")))


# byte 4k + i of a transposed group <- byte 16i + k of four 16-key channel rows: key k's 4 channels in one
# 32-bit lane, as vpdpbusd multiplies them (one vpermb)
_TRANSPOSE_4x16 = [16 * (n % 4) + n // 4 for n in range(64)]


def k_codes_group_u8(store, idx, t: KVType, tile, w):
    """uint8x64 codes of channels 4w .. 4w+3 for the 16 keys of tile `tile`, key-major (lane k = the key's
    4 channel codes) for vpdpbusd; idx = (slot, head, block). The 4 channel rows are contiguous."""
    slot, h, b = idx
    if t is KVType.Q8:
        raw = store[slot, h, b, tile, 4 * w, tirx.Ramp(0, 1, 64)]
    else:  # tile pair: tile 2j in the low nibbles, 2j + 1 in the high
        raw = nibbles_u8x64(store[slot, h, b, tile // 2, 4 * w, tirx.Ramp(0, 1, 64)], tile % 2)
    return tirx.Shuffle([raw], _TRANSPOSE_4x16)
