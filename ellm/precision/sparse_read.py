"""Which keys a block-sparse query reads, for the float model: the attention kernels' selection
(schedules/read_list.py) in NumPy, so the analysis can measure what a smaller top-K read budget costs.

Per query at position p and KV head (its G query heads share the blocks): the sink blocks, the window's
blocks (the last `window` tokens, at least the recent tier, the query's own block included), the `topk`
candidate blocks between them with the largest score bounds, then dynamic widening: while the best unread
candidate's bound exceeds the lowest of the G heads' best scores read so far less `margin`, read it too (at
most `widen` blocks, in falling bound order). Too few candidates, or dense mode: every block.

A block's bound is sum_d max(q_d lo_d, q_d hi_d) over its keys' per-channel range [lo_d, hi_d], the largest
over the G heads, with q scaled as the scores are. The kernels take the range from the store's summary (f16)
or params (min, min + qmax scale); here it is the range of the keys as read, in the store's basis (the
Walsh-Hadamard basis for rotated keys), which the params bound from above by at most a rounding step.
Ties at the top-K threshold are broken by block order (the kernels read every tied block).
"""

from __future__ import annotations

import numpy as np

from ..kv.attention import AttentionConfig
from .kv_read import hadamard

F32 = np.float32


class SparseSelect:
    """A float-model attention edit: the additive mask (0 read, -inf not) of the keys each query reads."""

    def __init__(self, attention: AttentionConfig, block: int = 64, recent: int = 2, rotate: bool = False):
        self.a, self.block, self.recent, self.rotate = attention, block, recent, rotate

    def __call__(self, q: np.ndarray, keys: np.ndarray, scores: np.ndarray, first: int) -> np.ndarray:
        """q [Hkv, G, c, hd] scaled queries at positions first..first+c-1; keys [n, Hkv, hd] as read; scores
        [Hkv, G, c, n] = q . keys. Returns the mask [Hkv, 1, c, n]."""
        a, B = self.a, self.block
        Hkv, G, c, hd = q.shape
        n = keys.shape[0]
        if a.mode == "dense":
            return np.zeros((Hkv, 1, c, n), F32)
        NB = -(-n // B)
        pos = first + np.arange(c)  # [c]
        cur = pos // B
        window = max(a.window, self.recent * B)
        wb = np.maximum(pos + 1 - window, 0) // B  # the window's first block
        sb = np.minimum(-(-a.sinks // B), wb)  # sink blocks: [0, sb)
        dense = (wb - sb) <= a.topk  # [c]
        blk = np.arange(NB)
        read = (blk[None, :] < sb[:, None]) | ((blk[None, :] >= wb[:, None]) & (blk[None, :] <= cur[:, None]))
        read = np.broadcast_to(read | (dense[:, None] & (blk[None, :] <= cur[:, None])), (Hkv, c, NB)).copy()
        cand = (blk[None, :] >= sb[:, None]) & (blk[None, :] < wb[:, None]) & ~dense[:, None]  # [c, NB]
        if cand.any():
            bound = self._bounds(q, keys)  # [Hkv, c, NB]
            ranked = np.where(cand[None], bound, -np.inf)
            order = np.argsort(-ranked, axis=-1, kind="stable")  # [Hkv, c, NB]: candidates by falling bound
            n_cand = cand.sum(axis=-1)  # [c]
            rank = np.arange(NB)
            top = (rank[None, None, :] < a.topk) & (rank[None, None, :] < n_cand[None, :, None])
            np.put_along_axis(read, order, np.take_along_axis(read, order, -1) | top, axis=-1)
            if a.widen > 0:
                self._widen(read, order, bound, scores, pos, n_cand)
        keymask = np.repeat(read, B, axis=-1)[..., :n]  # [Hkv, c, n]
        return np.where(keymask, F32(0), F32(-np.inf))[:, None]

    def _bounds(self, q: np.ndarray, keys: np.ndarray) -> np.ndarray:
        B = self.block
        n, Hkv, hd = keys.shape
        NB = -(-n // B)
        if self.rotate:
            h = hadamard(hd)
            keys, q = keys @ h, q @ h
        pad = np.concatenate([keys, np.repeat(keys[-1:], NB * B - n, axis=0)]) if NB * B > n else keys
        kb = pad.reshape(NB, B, Hkv, hd)
        lo, hi = kb.min(axis=1).transpose(1, 0, 2), kb.max(axis=1).transpose(1, 0, 2)  # [Hkv, NB, hd]
        qq = q[:, :, :, None, :]  # [Hkv, G, c, 1, hd]
        b = np.maximum(qq * lo[:, None, None], qq * hi[:, None, None]).sum(axis=-1)  # [Hkv, G, c, NB]
        return b.max(axis=1)

    def _widen(self, read, order, bound, scores, pos, n_cand) -> None:
        """Up to `widen` more candidates in falling bound order, while the next one's bound is above the lowest
        of the G heads' best scores so far less the margin (in place on read [Hkv, c, NB])."""
        a, B = self.a, self.block
        Hkv, G, c, n = scores.shape
        key_pos = np.arange(n)
        visible = key_pos[None, :] <= pos[:, None]  # [c, n]: causal
        keyread = np.repeat(read, B, axis=-1)[..., :n] & visible[None]  # [Hkv, c, n]
        m = np.where(keyread[:, None], scores, -np.inf).max(axis=-1)  # [Hkv, G, c]
        go = np.ones((Hkv, c), bool)
        hc, cc = np.meshgrid(np.arange(Hkv), np.arange(c), indexing="ij")
        for j in range(a.widen):
            r = a.topk + j  # the next unread candidate by bound
            ok = go & (r < n_cand[None, :])
            b = order[..., min(r, order.shape[-1] - 1)]  # [Hkv, c]
            take = ok & (bound[hc, cc, b] > m.min(axis=1) - a.margin)
            go = take
            if not take.any():
                break
            read[hc[take], cc[take], b[take]] = True
            lo = b * B  # the block's keys: its scores update the heads' best
            idx = np.clip(lo[..., None] + np.arange(B), 0, n - 1)  # [Hkv, c, B]
            blk_scores = np.take_along_axis(scores, np.broadcast_to(idx[:, None], (Hkv, G, c, B)), axis=-1)
            best = np.where(take[:, None], blk_scores.max(axis=-1), -np.inf)
            m = np.maximum(m, best)
