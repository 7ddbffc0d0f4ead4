"""The KV cache plan: block size, recent tier, and a precision class for K and for V of every layer.

Layout (B = block tokens, RS = ring slots, NB = blocks in the context, n = layers of a class). Keys are
stored transposed in tiles of 16 ([hd, 16] per tile: the scores of 16 keys are one vector, and a tile is
one contiguous stream):
  ring K   [L, Hkv, RS, B/16, hd, 16]  recent blocks; float16 (float32 for an f32 cache)
  ring V   [L, Hkv, RS, B, hd]
  K f16/f32 store [n, Hkv, NB, B/16, hd, 16] + summary [n, Hkv, NB, 2, hd] (per-channel min, max)
  K q8      codes [n, Hkv, NB, B/16, hd, 16] u8 + params [n, Hkv, NB, 2, hd] f16 (min, scale per channel)
  K q4      codes [n, Hkv, NB, B/32, hd, 16] u8: byte i of tile pair j holds key i of tile 2j (low nibble)
            and of tile 2j + 1 (high nibble); same params
  V f16/f32 store [n, Hkv, NB, B, hd]
  V q8      codes [n, Hkv, NB, hd/16, B/4, 64] u8: channels 16c .. 16c+15 of keys 4g .. 4g+3, byte 4i + k =
            channel 16c + i of key 4g + k (the 4 keys vpdpbusd sums in one 32-bit lane)
            + params [n, Hkv, NB, 2, B] f16 (min, scale per token)
  V q4      codes [n, Hkv, NB, hd/16, B/8, 64] u8: byte 4i + k of group m holds key 8m + k (low nibble) and
            key 8m + 4 + k (high nibble) of channel 16c + i; same params
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, replace
from typing import Any

from ..errors import EllmError


def layer_runs(values, label=str) -> str:
    """E.g. "q8 (0-3) q4 (4-29)": each run of equal per-layer values, labelled, and the layers it covers."""
    runs: list[list] = []  # [value, first, last]
    for i, v in enumerate(values):
        if runs and runs[-1][0] == v and runs[-1][2] == i - 1:
            runs[-1][2] = i
        else:
            runs.append([v, i, i])
    return " ".join(f"{label(v)} ({a}-{b})" if a != b else f"{label(v)} ({a})" for v, a, b in runs)


class KVType(str, enum.Enum):
    F32 = "f32"
    F16 = "f16"
    Q8 = "q8"
    Q4 = "q4"

    @property
    def is_float(self) -> bool:
        return self in (KVType.F32, KVType.F16)

    @property
    def dtype(self) -> str:
        """Element dtype of the store (codes for quantised classes)."""
        return {KVType.F32: "float32", KVType.F16: "float16"}.get(self, "uint8")

    @property
    def bits(self) -> int:
        return {KVType.F32: 32, KVType.F16: 16, KVType.Q8: 8, KVType.Q4: 4}[self]

    @property
    def qmax(self) -> int:
        return (1 << self.bits) - 1


# --cache-type-k / --cache-type-v spellings (llama.cpp's names map to eLLM's classes; q4 carries a min, like q4_1)
KV_TYPE_NAMES = {"f32": KVType.F32, "f16": KVType.F16, "q8_0": KVType.Q8, "q8": KVType.Q8, "q4_0": KVType.Q4, "q4": KVType.Q4}
AUTO = "auto"  # the per-layer plan of KVPlan.auto
KV_TYPE_CHOICES = (*KV_TYPE_NAMES, AUTO)
# auto: the stores may take this share of a plain float16 cache (K and V, every layer); the ring and the
# f16 summaries come on top (about 1.5% at 32K tokens), so the whole cache stays under 35% of float16
AUTO_BUDGET = 0.30


def parse_kv_type(name: str) -> KVType | None:
    """A --cache-type-k/v value: its KVType, or None for auto."""
    if name == AUTO:
        return None
    if name not in KV_TYPE_NAMES:
        raise EllmError(f"unsupported KV cache type {name!r} (supported: {', '.join(KV_TYPE_CHOICES)})")
    return KV_TYPE_NAMES[name]


@dataclass(frozen=True)
class StateTensor:
    """One tensor of the KV state tuple. `shape` uses "NB" for the (run-time) number of blocks."""

    name: str
    shape: tuple[int | str, ...]
    dtype: str


@dataclass(frozen=True)
class KVPlan:
    n_kv_heads: int
    head_dim: int
    k: tuple[KVType, ...]  # per layer
    v: tuple[KVType, ...]
    block: int = 64  # tokens per block
    recent: int = 2  # blocks (including the current one) a query sees at ring precision
    ring: int = 7  # ring slots: pinned + recent + ceil(max_chunk / block) + 1
    # the first `pinned` blocks stay in the ring (slots 0 .. pinned - 1) and are always read at ring precision:
    # the attention sinks' keys and values are outliers that a block's shared quantisation range serves badly
    pinned: int = 0
    # layers with a quantised K class store keys (and score queries) rotated by the orthonormal 64-point
    # Walsh-Hadamard transform of each head: q.k is unchanged, and a few large channels spread over the head
    # before per-channel quantisation
    rotate_k: bool = False

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v) or not self.k:
            raise EllmError("KV plan: K and V need one type per layer")
        if self.block % 32 or not 32 <= self.block <= 256:
            raise EllmError(f"KV block size must be a multiple of 32 in [32, 256], got {self.block}")
        if self.head_dim % 32:
            raise EllmError(f"the block KV cache needs head_dim divisible by 32, got {self.head_dim}")
        if self.recent < 1 or self.pinned < 0 or self.ring < self.pinned + self.recent + 1:
            raise EllmError(f"KV plan: bad recent tier ({self.recent} blocks), pinned blocks ({self.pinned}) or ring "
                            f"({self.ring} slots)")
        if self.rotate_k and self.head_dim & (self.head_dim - 1):
            raise EllmError(f"rotated keys need a power-of-two head_dim, got {self.head_dim}")
        floats = {t for t in self.k + self.v if t is KVType.F32}
        if floats and set(self.k + self.v) != floats:
            raise EllmError("an f32 KV cache must be f32 for every layer, K and V")

    @classmethod
    def per_layer(cls, n_kv_heads: int, head_dim: int, k: tuple[KVType, ...], v: tuple[KVType, ...], max_chunk: int,
                  block: int = 64, recent: int = 2, pinned: int = 0, rotate_k: bool = False) -> KVPlan:
        ring = pinned + recent + -(-max_chunk // block) + 1
        return cls(n_kv_heads, head_dim, tuple(k), tuple(v), block, recent, ring, pinned, rotate_k)

    @classmethod
    def uniform(cls, n_layers: int, n_kv_heads: int, head_dim: int, k: KVType, v: KVType, max_chunk: int,
                block: int = 64, recent: int = 2, pinned: int = 0, rotate_k: bool = False) -> KVPlan:
        return cls.per_layer(n_kv_heads, head_dim, (k,) * n_layers, (v,) * n_layers, max_chunk, block, recent, pinned,
                             rotate_k)

    @classmethod
    def auto(cls, n_layers: int, n_kv_heads: int, head_dim: int, max_chunk: int, k: KVType | None = None,
             v: KVType | None = None, block: int = 64, recent: int = 2, budget: float = AUTO_BUDGET, pinned: int = 0,
             rotate_k: bool = False) -> KVPlan:
        """Per-layer precision within `budget` of a float16 cache: the auto sides (k or v None) start at q4
        everywhere, then keys of the first layers, then values of the first layers, are raised to q8 while
        the stores fit. Early layers first: every later layer reads their output, so their rounding errors
        compound the most (the measured effect on SmolLM2 is in the README's KV table)."""
        base = cls.uniform(n_layers, n_kv_heads, head_dim, k or KVType.Q4, v or KVType.Q4, max_chunk, block, recent,
                           pinned, rotate_k)
        limit = budget * 2 * 2 * n_layers * n_kv_heads * head_dim
        if base.bytes_per_token() > limit:
            return base
        plan = base
        for kind in ("k", "v"):
            if (k if kind == "k" else v) is not None:
                continue
            for layer in range(n_layers):
                types = list(getattr(plan, kind))
                types[layer] = KVType.Q8
                trial = replace(plan, **{kind: tuple(types)})
                if trial.bytes_per_token() > limit:
                    return plan
                plan = trial
        return plan

    # --- classes and slots ------------------------------------------------------------------
    @property
    def n_layers(self) -> int:
        return len(self.k)

    @property
    def ring_dtype(self) -> str:
        return "float32" if self.k[0] is KVType.F32 else "float16"

    def classes(self, kind: str) -> list[KVType]:
        """The distinct types used for `kind` ("k" or "v"), in a fixed order."""
        used = set(getattr(self, kind))
        return [t for t in KVType if t in used]

    def rotates(self, kt: KVType) -> bool:
        """Whether layers of K class kt store their keys rotated (rotate_k and a quantised class)."""
        return self.rotate_k and not kt.is_float

    def rotated(self, layer: int) -> bool:
        return self.rotates(self.k[layer])

    def ring_slot(self, b: int) -> int:
        """The ring slot of block b: pinned blocks keep their own, the others cycle through the rest."""
        return b if b < self.pinned else self.pinned + (b - self.pinned) % (self.ring - self.pinned)

    def slot(self, kind: str, layer: int) -> tuple[KVType, int]:
        """(type, index of `layer` among the layers of that type) for K or V."""
        types = getattr(self, kind)
        t = types[layer]
        return t, sum(1 for x in types[:layer] if x is t)

    # --- the state tuple ---------------------------------------------------------------------
    def store_tensors(self, kind: str, t: KVType) -> list[StateTensor]:
        n = sum(1 for x in getattr(self, kind) if x is t)
        H, hd, B = self.n_kv_heads, self.head_dim, self.block
        if kind == "k":
            tiles = B // 32 if t is KVType.Q4 else B // 16
            data = StateTensor(f"k_{t.value}", (n, H, "NB", tiles, hd, 16), t.dtype)
            side_dtype = "float32" if t is KVType.F32 else "float16"
            side = StateTensor(f"k_{t.value}_{'summary' if t.is_float else 'params'}", (n, H, "NB", 2, hd), side_dtype)
            return [data, side]
        if t.is_float:
            return [StateTensor(f"v_{t.value}", (n, H, "NB", B, hd), t.dtype)]
        groups = B // 4 if t is KVType.Q8 else B // 8
        return [StateTensor(f"v_{t.value}", (n, H, "NB", hd // 16, groups, 64), t.dtype),
                StateTensor(f"v_{t.value}_params", (n, H, "NB", 2, B), "float16")]

    def layer_tensors(self, kt: KVType, vt: KVType) -> list[StateTensor]:
        """The state tensors a cache kernel of a layer with K class kt and V class vt takes, in argument
        order: the ring (K, V), then the K store (codes, summary or params) and the V store (codes[, params])."""
        return self.state_tensors()[:2] + self.store_tensors("k", kt) + self.store_tensors("v", vt)

    def state_tensors(self) -> list[StateTensor]:
        """Every tensor of the KV state, in the order the compiled functions take them."""
        L, H, hd, B, RS = self.n_layers, self.n_kv_heads, self.head_dim, self.block, self.ring
        out = [StateTensor("ring_k", (L, H, RS, B // 16, hd, 16), self.ring_dtype),
               StateTensor("ring_v", (L, H, RS, B, hd), self.ring_dtype)]
        for kind in ("k", "v"):
            for t in self.classes(kind):
                out += self.store_tensors(kind, t)
        return out

    def n_blocks(self, ctx: int) -> int:
        return -(-ctx // self.block)

    def nbytes(self, ctx: int) -> int:
        """Bytes of the whole KV state for a context of `ctx` tokens."""
        import numpy as np

        nb = self.n_blocks(ctx)
        total = 0
        for s in self.state_tensors():
            n = 1
            for d in s.shape:
                n *= nb if d == "NB" else int(d)
            total += n * np.dtype(s.dtype).itemsize
        return total

    def read_bytes(self, ctx: int, attention, layer: int | None = None, kinds: tuple[str, ...] = ("k", "v")) -> int:
        """Bytes of the stores a query at position ctx - 1 reads with `attention` (an AttentionConfig, before
        widening): the K and V blocks of the keys it reads (whole blocks) and the K summaries or params of the
        candidate blocks it bounds, at the types of `layer`, or summed over every layer (`kinds`: K, V or both)."""
        import numpy as np

        ring = KVType.F32 if self.ring_dtype == "float32" else KVType.F16
        total = 0
        for i in range(self.n_layers) if layer is None else (layer,):
            a = attention.for_layer(i)  # a per-layer read budget
            keys, candidates = a.blocks_read(ctx, self.block, self.recent)
            blocks = -(-keys // self.block)
            pinned = min(self.pinned, blocks, self.n_blocks(ctx)) if a.reads_first(ctx, self.block, self.recent) else 0
            for kind in kinds:
                for t, n, stored in ((getattr(self, kind)[i], blocks - pinned, True), (ring, pinned, False)):
                    for st in self.store_tensors(kind, t):  # [slots, heads, NB, ...]
                        b = int(np.prod([int(d) for d in st.shape[1:] if d != "NB"])) * np.dtype(st.dtype).itemsize
                        side = kind == "k" and st.name.endswith(("_params", "_summary"))
                        if stored or not side:  # a pinned block is read from the ring: no summary or params
                            total += b * n
                        if stored and side:
                            total += b * candidates
        return total

    def bytes_per_token(self) -> float:
        """Store bytes per token (the ring is a fixed overhead), over all layers, K and V."""
        per_block = self.nbytes(self.block * 1024) - self.nbytes(0)
        return per_block / (self.block * 1024)

    def describe(self) -> str:
        """E.g. "K q8 (layers 0-3) q4 (4-29), V q4": each type and the layers that use it."""

        def side(types) -> str:
            return types[0].value if len(set(types)) == 1 else layer_runs(types, lambda t: t.value)

        return f"K {side(self.k)}, V {side(self.v)}"

    # --- manifest -------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"n_kv_heads": self.n_kv_heads, "head_dim": self.head_dim, "block": self.block, "recent": self.recent,
                "ring": self.ring, "pinned": self.pinned, "rotate_k": self.rotate_k,
                "k": [t.value for t in self.k], "v": [t.value for t in self.v],
                "state": [{"name": s.name, "shape": list(s.shape), "dtype": s.dtype} for s in self.state_tensors()]}

    def key(self) -> str:
        """A canonical string form (kernel requests carry it as an attribute)."""
        import json

        d = self.to_dict()
        del d["state"]
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_key(cls, key: str) -> KVPlan:
        import json

        return cls.from_dict(json.loads(key))

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KVPlan:
        return cls(int(d["n_kv_heads"]), int(d["head_dim"]), tuple(KVType(x) for x in d["k"]),
                   tuple(KVType(x) for x in d["v"]), int(d["block"]), int(d["recent"]), int(d["ring"]),
                   int(d.get("pinned", 0)), bool(d.get("rotate_k", False)))  # older artifacts: neither
