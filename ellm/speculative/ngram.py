"""Prompt lookup: drafts copied from where the text's current suffix occurred before."""

from __future__ import annotations

from typing import Sequence


class NgramIndex:
    """For every n-gram (n_min <= n <= n_max) of a growing token sequence, where its latest occurrence that
    has a continuation ends. Appending a token costs n_max dictionary writes; a lookup costs at most
    n_max - n_min + 1 dictionary reads, whatever the sequence's length (no rescans)."""

    def __init__(self, n_max: int = 4, n_min: int = 1, tokens: Sequence[int] = ()):
        self.n_max, self.n_min = n_max, n_min
        self.tokens: list[int] = []
        self._next: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token that followed it last
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        seq = self.tokens
        i = len(seq)  # the n-grams ending at i - 1 now have a continuation: seq[i]
        for n in range(self.n_min, min(self.n_max, i) + 1):
            self._next[tuple(seq[i - n : i])] = i
        seq.append(int(token))

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            self.append(t)

    def truncate(self, n: int) -> None:
        """Forget tokens from n on (rebuilds the index: for rollbacks past what was indexed, not per step)."""
        if n < len(self.tokens):
            kept = self.tokens[:n]
            self.tokens, self._next = [], {}
            self.extend(kept)

    def propose(self, k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the longest suffix of the sequence seen before, and that suffix's
        length (0 and no tokens where nothing matches)."""
        seq = self.tokens
        for n in range(min(self.n_max, len(seq)), self.n_min - 1, -1):
            at = self._next.get(tuple(seq[len(seq) - n :]))
            if at is not None:
                return seq[at : at + k], n
        return [], 0
