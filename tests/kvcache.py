"""Test helpers for the block KV cache: an independent NumPy model of its layout, quantisers and tiers."""

from __future__ import annotations

import numpy as np

from ellm.kv.plan import KVPlan, KVType


def cache_attrs(plan: KVPlan, layer: int) -> tuple:
    """The attributes plan_kv_cache puts on a cache op of `layer`."""
    return (("kv_k", plan.k[layer].value), ("kv_plan", plan.key()), ("kv_v", plan.v[layer].value))


def empty_state(plan: KVPlan, ctx: int) -> list[np.ndarray]:
    """A KV state whose float parts are NaN and codes 0, so reading anything unwritten shows."""
    nb = plan.n_blocks(ctx)
    out = []
    for s in plan.state_tensors():
        shape = tuple(nb if d == "NB" else int(d) for d in s.shape)
        out.append(np.full(shape, np.nan, s.dtype) if s.dtype.startswith("float") else np.zeros(shape, s.dtype))
    return out


def layer_args(plan: KVPlan, layer: int, state: list) -> list:
    """The state tensors a kernel of `layer` takes, in order (as lowering passes them)."""
    names = [s.name for s in plan.state_tensors()]
    kt, vt = plan.k[layer], plan.v[layer]
    want = ["ring_k", "ring_v"] + [s.name for s in plan.store_tensors("k", kt)] + [s.name for s in plan.store_tensors("v", vt)]
    return [state[names.index(n)] for n in want]


def quantise_codes(x: np.ndarray, t: KVType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of x [rows, cols] -> (codes, min, scale) per row, asymmetric, params in float16."""
    x = x.astype(np.float32)
    mn = x.min(axis=1).astype(np.float16).astype(np.float32)
    sc = ((x.max(axis=1) - mn) / t.qmax).astype(np.float16).astype(np.float32)
    inv = np.where(sc > 0, 1.0 / np.where(sc > 0, sc, 1), 0.0).astype(np.float32)
    return np.clip(np.floor((x - mn[:, None]) * inv[:, None] + 0.5), 0, t.qmax), mn, sc


def quantise_ref(x: np.ndarray, t: KVType) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows of x [rows, cols] -> (dequantised, min, scale) per row, asymmetric, params in float16."""
    codes, mn, sc = quantise_codes(x, t)
    return (mn[:, None] + sc[:, None] * codes).astype(np.float32), mn, sc


def value_codes(vd: np.ndarray, t: KVType, B: int, hd: int) -> np.ndarray:
    """A stored V block's codes [hd/16, groups, 64] -> [B, hd]: byte 4i + k of group g is channel 16c + i
    of key 4g + k (q4: group m holds key groups 2m (low nibbles) and 2m + 1 (high))."""
    if t is KVType.Q4:
        vd = np.stack([vd & 15, vd >> 4], axis=2).reshape(hd // 16, B // 4, 64)
    codes = vd.reshape(hd // 16, B // 4, 16, 4)  # [c, g, i, k]
    return codes.transpose(1, 3, 0, 2).reshape(B, hd).astype(np.float32)


def stored_block(plan: KVPlan, layer: int, state_by_name: dict, h: int, b: int) -> tuple[np.ndarray, np.ndarray]:
    """(K [B, hd], V [B, hd]) of block b as the store holds it, dequantised."""
    B, hd = plan.block, plan.head_dim
    kt, ks = plan.slot("k", layer)
    vt, vs = plan.slot("v", layer)
    kd = state_by_name[f"k_{kt.value}"][ks, h, b]  # [tiles, hd, 16]
    if kt is KVType.Q4:  # tile pair j: tile 2j in the low nibbles, 2j + 1 in the high
        kd = np.stack([kd & 15, kd >> 4], axis=1).reshape(-1, hd, 16)
    keys = kd.transpose(0, 2, 1).reshape(B, hd).astype(np.float32)  # [B, hd]
    if kt.is_float:
        k = keys
    else:
        p = state_by_name[f"k_{kt.value}_params"][ks, h, b].astype(np.float32)  # [2, hd]
        k = p[0][None, :] + p[1][None, :] * keys
    vd = state_by_name[f"v_{vt.value}"][vs, h, b]
    if vt.is_float:
        v = vd.astype(np.float32)
    else:
        p = state_by_name[f"v_{vt.value}_params"][vs, h, b].astype(np.float32)  # [2, B]
        v = p[0][:, None] + p[1][:, None] * value_codes(vd, vt, B, hd)
    return k, v


def visible(plan: KVPlan, layer: int, k: np.ndarray, v: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
    """What a query at position t sees of keys/values k, v [Hkv, >t, hd] (float32, the appended values):
    ring precision for the `recent` newest blocks, the store's dequantised values before them."""
    B = plan.block
    rd = np.dtype(plan.ring_dtype)
    ks = k[:, : t + 1].astype(rd).astype(np.float64)
    vs = v[:, : t + 1].astype(rd).astype(np.float64)
    for b in stored_blocks(plan, t):
        blk = slice(b * B, (b + 1) * B)
        for h in range(k.shape[0]):
            for arr, kind in ((ks, plan.k[layer]), (vs, plan.v[layer])):
                if kind.is_float:
                    arr[h, blk] = arr[h, blk].astype(kind.dtype).astype(np.float64)
                elif arr is ks:  # keys: per channel over the block
                    arr[h, blk] = quantise_ref(arr[h, blk].T, kind)[0].T
                else:  # values: per token over channels
                    arr[h, blk] = quantise_ref(arr[h, blk], kind)[0]
    return ks, vs


def pinned_extra(model, kv_bytes_per_token: float, block: int = 64) -> int:
    """What a decode step of the GGUF `model` reads beyond `kv_bytes_per_token` per token of context: the
    pinned first block (the protected store, the compile default) comes at float16, K and V of every layer
    and KV head, instead of at its store type."""
    from ellm.compiler.gguf_file import GGUFFile
    from ellm.config import ModelConfig

    cfg = ModelConfig.from_gguf(GGUFFile(model))
    return int(2 * cfg.n_layers * cfg.n_kv_heads * block * cfg.head_dim * 2 - kv_bytes_per_token * block)


def stored_blocks(plan: KVPlan, t: int) -> range:
    """Blocks a query at position t reads from the store: those before the recent tier, less the pinned ones."""
    return range(plan.pinned, max(0, t // plan.block - plan.recent + 1))


def rotated_keys(plan: KVPlan, layer: int, x: np.ndarray) -> np.ndarray:
    """Keys or queries [..., hd] (last axis one head) in the basis `layer` stores its keys in: the head's
    Hadamard basis where the plan rotates them, else as given."""
    from ellm.precision.kv_read import hadamard

    return x @ hadamard(plan.head_dim) if plan.rotated(layer) else x


def attention_ref(q: np.ndarray, ks: np.ndarray, vs: np.ndarray, H: int) -> np.ndarray:
    """One query [H * hd] against visible K, V [Hkv, n, hd]: float64 softmax attention."""
    Hkv, _, hd = ks.shape
    G = H // Hkv
    out = np.zeros(H * hd)
    for h in range(H):
        s = ks[h // G] @ q[h * hd : (h + 1) * hd].astype(np.float64) / np.sqrt(hd)
        p = np.exp(s - s.max())
        out[h * hd : (h + 1) * hd] = (p / p.sum()) @ vs[h // G]
    return out


def ring_tokens(plan: KVPlan, state: list[np.ndarray], layer: int, positions) -> tuple[np.ndarray, np.ndarray]:
    """(K, V) [len(positions), Hkv, hd] of tokens as the ring holds them (float32)."""
    rk, rv = state[0], state[1]
    B = plan.block
    k = np.stack([rk[layer, :, plan.ring_slot(p // B), (p % B) // 16, :, p % 16] for p in positions]).astype(np.float32)
    v = np.stack([rv[layer, :, plan.ring_slot(p // B), p % B, :] for p in positions]).astype(np.float32)
    return k, v


def clear_ring_tokens(plan: KVPlan, state: list[np.ndarray], layer: int, positions) -> None:
    """Set the ring entries of `positions` back to NaN (so a test can check nothing else was written)."""
    B = plan.block
    for p in positions:
        state[0][layer, :, plan.ring_slot(p // B), (p % B) // 16, :, p % 16] = np.nan
        state[1][layer, :, plan.ring_slot(p // B), p % B, :] = np.nan


def block_bounds_ref(plan: KVPlan, layer: int, ks: np.ndarray, q: np.ndarray, h: int, n_blocks: int, H: int) -> np.ndarray:
    """Score bounds of blocks 0..n_blocks-1 of KV head h for query q [H * hd], from each block's
    per-channel key range as the store records it (quantised: [min, min + qmax scale])."""
    B, hd = plan.block, plan.head_dim
    kt = plan.k[layer]
    G = H // ks.shape[0]
    qs = q.astype(np.float64).reshape(H, hd)[h * G : (h + 1) * G] / np.sqrt(hd)  # [G, hd]
    out = np.zeros(n_blocks)
    for b in range(n_blocks):
        raw = ks[h, b * B : (b + 1) * B]  # [B, hd] as the ring held them
        if kt.is_float:
            lo, hi = raw.min(0), raw.max(0)
        else:
            _, mn, sc = quantise_ref(raw.T.astype(np.float32), kt)
            lo, hi = mn.astype(np.float64), mn + kt.qmax * sc.astype(np.float64)
        out[b] = np.max(np.maximum(qs * lo, qs * hi).sum(1))
    return out


def sparse_ref(plan: KVPlan, layer: int, k: np.ndarray, v: np.ndarray, q: np.ndarray, t: int, H: int,
               sinks: int, window: int, topk: int, int_bits: int, widen: int = 0, margin: float = 0.0
               ) -> tuple[np.ndarray, np.ndarray]:
    """(output, slack) as attend_ref, of block-sparse attention of one query at position t: sink blocks, the block-aligned window, and the
    top-K remote blocks by bound, each KV head choosing for its G query heads; then widening: while the
    best unread candidate's bound exceeds the lowest of the G heads' best scores minus `margin`, read it
    (at most `widen` blocks, in decreasing bound order)."""
    B = plan.block
    G = H // k.shape[0]
    rd = np.dtype(plan.ring_dtype)
    raw = k[:, : t + 1].astype(rd).astype(np.float64)
    s = scores_ref(plan, layer, k, q, t, H, int_bits)
    keys = []
    for h in range(k.shape[0]):
        bounds = {}
        kept = sparse_keys(plan, t, sinks, window, topk, lambda n: bounds.setdefault("all", block_bounds_ref(plan, layer, raw, q, h, n, H)))
        if "all" in bounds and widen:
            wb = len(bounds["all"])
            sb = min(-(-sinks // B), wb)
            read = set(kept.tolist())
            unread = sorted((b for b in range(sb, wb) if b * B not in read), key=lambda b: (-bounds["all"][b], b))
            for b in unread[:widen]:
                m_low = min(s[h * G + g, sorted(read)].max() for g in range(G))
                if not bounds["all"][b] > m_low - margin:
                    break
                read |= set(range(b * B, (b + 1) * B))
            kept = np.array(sorted(read))
        keys.append(kept)
    return attend_ref(plan, layer, k, v, q, t, H, int_bits, keys)


def sparse_keys(plan: KVPlan, t: int, sinks: int, window: int, topk: int, bounds_of) -> np.ndarray:
    """Positions a query at t reads: sink blocks, the top-K candidates by bounds_of(n_blocks), the window."""
    B, n_ctx = plan.block, t + 1
    wb = max(n_ctx - max(window, plan.recent * B), 0) // B
    sb = min(-(-sinks // B), wb)  # sink blocks: the first `sinks` tokens rounded up to whole blocks
    if wb - sb <= topk:
        return np.arange(n_ctx)
    chosen = sorted(sb + np.argsort(-bounds_of(wb)[sb:], kind="stable")[:topk])
    return np.concatenate([np.arange(sb * B)] + [np.arange(b * B, (b + 1) * B) for b in chosen] + [np.arange(wb * B, n_ctx)])


def qmax_of(bits: int) -> int:
    """The rounded values' largest magnitude: 127 * 256 for 16 bits (two int8 halves), 127 for 8."""
    return 127 * 256 if bits == 16 else 127


# Rotated keys (plan.rotated): the kernels rotate the query with float32 butterflies, whose rounding the
# model's rotation does not follow bit for bit, so a query component within this many rounding steps of a
# tie (x.5) may round either way there.
Q_TIE = 1e-3


def scores_ref(plan: KVPlan, layer: int, k: np.ndarray, q: np.ndarray, t: int, H: int, int_bits: int,
               flip: tuple[int, int, int] | None = None, ties: list | None = None) -> np.ndarray:
    """[H, t + 1] scaled scores of query q [H * hd] at position t, as the kernels compute them. With
    `int_bits` (the integer paths: 16 or 8; 0: float), keys of quantised store blocks score as
    kc + qf * sum_d qi_d code_d: q * scale rounded to int_bits bits per head and block
    (qf = max |q * scale| / qmax_of(int_bits)), the sum exact. On rotated layers, `ties` (a list) collects
    the (head, block, dimension) of query components within Q_TIE of a rounding tie; `flip` rounds one of
    them the other way."""
    B, hd = plan.block, plan.head_dim
    Hkv = k.shape[0]
    G = H // Hkv
    ks, _ = visible(plan, layer, k, k, t)
    qs = (q.astype(np.float32) * np.float32(1.0 / np.sqrt(hd))).reshape(H, hd)
    s = np.stack([ks[h // G] @ qs[h].astype(np.float64) for h in range(H)])
    kt = plan.k[layer]
    if not int_bits or kt.is_float:
        return s
    rd = np.dtype(plan.ring_dtype)
    for b in stored_blocks(plan, t):  # blocks read from the store
        raw = k[:, b * B : (b + 1) * B].astype(rd).astype(np.float32)  # [Hkv, B, hd]
        for h in range(H):
            codes, mn, sc = quantise_codes(raw[h // G].T, kt)  # [hd, B], [hd], [hd]
            qk = qs[h] * sc  # float32, as the kernel folds the scales into the query
            amax = np.abs(qk).max()
            qmax = np.float32(qmax_of(int_bits))
            inv = qmax / amax if amax > 0 else np.float32(0.0)
            x = qk * inv
            qi = np.floor(x + np.float32(0.5))
            if plan.rotated(layer):
                near = np.flatnonzero(np.abs((x % 1.0) - 0.5) < Q_TIE)
                if ties is not None:
                    ties += [(h, b, int(d)) for d in near]
                if flip is not None and flip[:2] == (h, b):
                    d = flip[2]
                    qi[d] = np.floor(x[d]) if qi[d] > x[d] else np.ceil(x[d])
            kc = (qs[h].astype(np.float64) * mn).sum()
            s[h, b * B : (b + 1) * B] = kc + np.float64(amax / qmax) * (qi.astype(np.float64) @ codes)
    return s


def attend_ref(plan: KVPlan, layer: int, k: np.ndarray, v: np.ndarray, q: np.ndarray, t: int, H: int,
               int_bits: int, keys: list | None = None, value_bits: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(output, slack): one query [H * hd] at position t over the keys in keys[kv head] (default: all t + 1),
    float64 softmax of scores_ref (rounded to `int_bits`) over the visible values. With `value_bits` (the
    values' integer path; default int_bits, 0: float), quantised store blocks of values sum as
    p_j min_j + w_j code_j with w_j = p_j scale_j rounded to value_bits bits relative to the block's largest w
    (as the kernels' integer path does).

    The kernels compute p_j in float32 (their own exp), so a w_j within float32 noise of a rounding tie may
    round the other way there: `slack` [H * hd] is what such ties can move the output by (one step f of the
    rounding times the largest code, over the softmax sum, per tie). At 16 bits it is negligible; at 8 bits a
    single tie is a few 1e-4."""
    ties: list = []
    s = scores_ref(plan, layer, k, q, t, H, int_bits, ties=ties)
    out, slack = _attend(plan, layer, s, k, v, t, H, int_bits, keys, value_bits)
    for tie in ties:  # a query component the kernel may round the other way: what that would change
        alt, _ = _attend(plan, layer, scores_ref(plan, layer, k, q, t, H, int_bits, flip=tie), k, v, t, H, int_bits,
                         keys, value_bits)
        slack += np.abs(alt - out)
    return out, slack


def _attend(plan: KVPlan, layer: int, s: np.ndarray, k: np.ndarray, v: np.ndarray, t: int, H: int, int_bits: int,
            keys: list | None, value_bits: int | None) -> tuple[np.ndarray, np.ndarray]:
    """attend_ref over given scores s [H, t + 1]."""
    B, hd = plan.block, plan.head_dim
    G = H // k.shape[0]
    _, vs = visible(plan, layer, k, v, t)
    vt = plan.v[layer]
    value_bits = int_bits if value_bits is None else value_bits
    blocks = stored_blocks(plan, t) if value_bits and not vt.is_float else range(0)
    rd = np.dtype(plan.ring_dtype)
    quant = [{b: quantise_codes(v[h, b * B : (b + 1) * B].astype(rd), vt) for b in blocks} for h in range(k.shape[0])]
    out, slack = np.zeros(H * hd), np.zeros(H * hd)
    for h in range(H):
        idx = np.arange(t + 1) if keys is None else keys[h // G]
        p = np.exp(s[h, idx] - s[h, idx].max())
        from_store = np.isin(idx // B, list(blocks))
        o = p[~from_store] @ vs[h // G][idx[~from_store]]
        for b in sorted(set(idx[from_store] // B)):
            codes, mn, sc = quant[h // G][b]  # [B, hd], [B], [B]
            pb = p[(idx >= b * B) & (idx < (b + 1) * B)]
            w = pb * sc
            f = w.max() / qmax_of(value_bits)
            o += pb @ mn + (np.floor(w / f + 0.5) * f if f > 0 else w) @ codes
            if f > 0:
                ties = np.abs((w / f) % 1.0 - 0.5) < 1e-4
                slack[h * hd : (h + 1) * hd] += ties.sum() * f * vt.qmax / p.sum()
        out[h * hd : (h + 1) * hd] = o / p.sum()
    return out, slack
