"""The block KV cache inside kernels: declaring its buffers, writing tokens into the ring, quantising a
block when it completes, and reading a block (16 keys at a time) for attention.

Layouts are kv/plan.py's. A query at position t reads block b from the ring (float16) when
b > t // B - recent, else from its class's store; both paths are emitted and chosen per block.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import tirx
from tvm.tirx.script.builder import ir as I

from ..kv.plan import KVPlan, KVType
from .vecmath import hmax, hreduce

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
    int_scores: bool = False  # score quantised key blocks with vpdpbusd (int8 query, needs VNNI + VBMI)

    @classmethod
    def declare(cls, plan: KVPlan, kt: KVType, vt: KVType, int_scores: bool = False) -> KVBuffers:
        """The buffers of a layer whose K and V classes are kt and vt, in KVPlan.layer_tensors order."""
        nb = tirx.Var("NB", "int64")
        args = [I.arg(st.name, I.buffer(tuple(nb if d == "NB" else d for d in st.shape), st.dtype))
                for st in plan.layer_tensors(kt, vt)]
        ring_k, ring_v, k_store, k_side, v_store, *v_params = args
        return cls(plan, kt, vt, ring_k, ring_v, k_store, k_side, v_store, v_params[0] if v_params else None, nb,
                   int_scores and not kt.is_float)

    @staticmethod
    def step_args():
        """The scalar arguments of every cache kernel, after its buffers: (pos, layer, kslot, vslot) = the
        step's first position, the layer, and the layer's index in its K and V storage classes."""
        return tuple(I.arg(name, tirx.Var(name, "int64")) for name in ("pos", "layer", "kslot", "vslot"))

    @property
    def block(self) -> int:
        return self.plan.block

    def ring_slot(self, b):
        return b % self.plan.ring

    # --- writing -------------------------------------------------------------------------
    def write_k(self, layer, h, p, vecs) -> None:
        """Key of the token at position p (head_dim / 16 float32 vectors) into the ring, transposed."""
        B, dt = self.block, self.plan.ring_dtype
        slot = self.ring_slot(p // B)
        for j, v in enumerate(vecs):
            kv = tirx.Cast(f"{dt}x{L}", v)
            for lane in range(L):
                I.buffer_store(self.ring_k, tirx.Shuffle([kv], [lane]), [layer, h, slot, (p % B) // L, j * L + lane, p % L])

    def write_k_scalar(self, layer, h, p, d, value) -> None:
        B = self.block
        I.buffer_store(self.ring_k, tirx.Cast(self.plan.ring_dtype, value),
                       [layer, h, self.ring_slot(p // B), (p % B) // L, d, p % L])

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
            _store_row(xs, self.kt, self.k_store, dst, self.k_side, (kslot, h, b), d, "k")

    def store_v_block(self, layer, vslot, h, b) -> None:
        """Ring block b -> the V store; rows are tokens."""
        B, hd = self.block, self.plan.head_dim
        with I.serial(0, B) as j:
            xs = [I.Bind(tirx.Cast(F32, self.ring_v[layer, h, self.ring_slot(b), j, ramp(c * L)])) for c in range(hd // L)]
            half = hd // L // 2
            if self.vt is KVType.Q4:  # byte i: channel i low nibble, channel i + hd/2 high
                dst = [((vslot, h, b, j), c % half * L, c // half) for c in range(hd // L)]
            else:
                dst = [((vslot, h, b, j), c * L, 0) for c in range(hd // L)]
            _store_row(xs, self.vt, self.v_store, dst, self.v_params, (vslot, h, b), j, "v")


def _store_row(xs, t: KVType, dst, places, side, side_idx, r, kind: str) -> None:
    """One row (a K channel over the block's keys, or a V token over its channels) of 16-lane vectors
    `xs` into the store. places[c] = (index prefix, nibble) for K (the vector's lanes are the last axis),
    (index prefix, lane offset, nibble) for V. Float types copy, and K records the row's (min, max) as
    the block summary. Quantised types record (min, scale) in float16 and codes round((x - min) / scale)
    in [0, qmax], computed with the rounded min and scale, so every dequantised value min + scale * code
    lies in [min, min + scale * qmax]."""
    lo_v, hi_v = xs[0], xs[0]
    for x in xs[1:]:
        lo_v, hi_v = tirx.min(lo_v, x), tirx.max(hi_v, x)
    lo, hi = I.Bind(hmin(lo_v)), I.Bind(hmax(hi_v))

    def index(c):
        if kind == "k":
            prefix, nib = places[c]
            return [*prefix, ramp(0)], nib
        prefix, off, nib = places[c]
        return [*prefix, ramp(off)], nib

    def side_at(which):
        return [*side_idx, which, r] if kind == "k" else [*side_idx, r, which]

    if t.is_float:
        for c, x in enumerate(xs):
            I.buffer_store(dst, tirx.Cast(f"{t.dtype}x{L}", x), index(c)[0])
        if kind == "k":
            I.buffer_store(side, tirx.Cast(side.dtype, lo), side_at(0))
            I.buffer_store(side, tirx.Cast(side.dtype, hi), side_at(1))
        return
    mn = I.Bind(tirx.Cast("float32", tirx.Cast("float16", lo)))
    sc16 = I.Bind(tirx.Cast("float16", (hi - mn) / f32(float(t.qmax))))
    sc = I.Bind(tirx.Cast("float32", sc16))
    inv = I.Bind(tirx.Select(sc > f32(0.0), f32(1.0) / sc, f32(0.0)))
    I.buffer_store(side, tirx.Cast("float16", mn), side_at(0))
    I.buffer_store(side, sc16, side_at(1))
    codes = []
    for x in xs:
        q = tirx.floor((x - bc(mn)) * bc(inv) + bc(f32(0.5)))
        q = tirx.max(tirx.min(q, bc(f32(float(t.qmax)))), bc(f32(0.0)))
        codes.append(I.Bind(tirx.Cast(f"uint8x{L}", tirx.Cast(f"int32x{L}", q))))
    if t is KVType.Q8:
        for c, code in enumerate(codes):
            I.buffer_store(dst, code, index(c)[0])
        return
    pairs: dict[str, list] = {}
    for c, code in enumerate(codes):  # group the low and high nibble of each byte vector
        idx, nib = index(c)
        pairs.setdefault(str(idx), [idx, None, None])[1 + nib] = code
    for idx, low, high in pairs.values():
        I.buffer_store(dst, low | (high << bc(tirx.const(4, "uint8"))), idx)


# --- reading -----------------------------------------------------------------------------
def k_codes_f32(store, idx, t: KVType, tile):
    """float32x16 of the codes of 16-key tile `tile` at channel row idx = (slot, head, block, ..., d)."""
    slot, h, b, d = idx
    if t is KVType.Q8:
        return tirx.Cast(F32, store[slot, h, b, tile, d, ramp(0)])
    byte = store[slot, h, b, tile // 2, d, ramp(0)]
    return _nibbles(byte, tile % 2)


def v_codes_f32(store, idx, t: KVType, c: int, hd: int):
    """float32x16 of the codes of channels 16c .. 16c+15 of a stored V row idx = (slot, head, block, token)."""
    if t is KVType.Q8:
        return tirx.Cast(F32, store[(*idx, ramp(c * L))])
    half = hd // L // 2
    return _nibbles(store[(*idx, ramp(c % half * L))], c // half)


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
        raw = store[slot, h, b, tile // 2, 4 * w, tirx.Ramp(0, 1, 64)]
        shift = tirx.Broadcast(tirx.Cast("uint8", (tile % 2) * 4), 64)
        raw = (raw >> shift) & tirx.Broadcast(tirx.const(15, "uint8"), 64)
    return tirx.Shuffle([raw], _TRANSPOSE_4x16)
