"""Generated tokens as text, piece by piece: incremental detokenization that never splits a UTF-8 character,
and stop strings matched across token boundaries and never emitted.

A stop string may begin inside one token and end several tokens later, so text that could still be the
start of a stop string is held back until the next token settles it; at the end of generation what is held
back is released (`finish`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

from ..errors import EllmError, quoted

MAX_STOPS = 16
MAX_STOP_CHARS = 256


def check_stops(stops: Sequence[str]) -> tuple[str, ...]:
    """Stop strings as a request gives them: at most MAX_STOPS, each non-empty and short."""
    stops = tuple(stops)
    if len(stops) > MAX_STOPS:
        raise EllmError(f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise EllmError(f"a stop string must be a non-empty string, got {quoted(s)}")
        if len(s) > MAX_STOP_CHARS:
            raise EllmError(f"a stop string has at most {MAX_STOP_CHARS} characters, got {len(s)}")
    return stops


@dataclass
class StopMatcher:
    """Feeds text in, gives back what may be shown; `stopped` once a stop string appeared (it and anything
    after it are dropped)."""

    stops: tuple[str, ...] = ()
    pending: str = ""  # text received but not yet released: it ends with a possible start of a stop string
    stopped: bool = False
    matched: str | None = None

    def feed(self, text: str) -> str:
        if self.stopped:
            return ""
        buf = self.pending + text
        hit = min(((i, s) for s in self.stops if (i := buf.find(s)) >= 0), default=None)
        if hit is not None:
            self.stopped, self.matched, self.pending = True, hit[1], ""
            return buf[: hit[0]]
        hold = _held(buf, self.stops)
        self.pending = buf[len(buf) - hold :] if hold else ""
        return buf[: len(buf) - hold]

    def finish(self) -> str:
        out, self.pending = ("" if self.stopped else self.pending), ""
        return out


def _held(buf: str, stops: tuple[str, ...]) -> int:
    """The length of the longest suffix of `buf` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(buf)), best, -1):
            if buf.endswith(s[:n]):
                best = n
                break
    return best


@dataclass
class TextStream:
    """Token ids in, text out, for one generation. End-of-generation tokens give no text. `feed` returns
    the text to show now (possibly empty); `finish` the rest."""

    tokenizer: object
    stops: tuple[str, ...] = ()
    ids: list[int] = field(default_factory=list)
    _prefix: int = 0  # ids[_prefix:_read] were decoded already: decoding from _prefix gives context for merges
    _read: int = 0
    _matcher: StopMatcher = field(init=False)

    def __post_init__(self):
        self._matcher = StopMatcher(tuple(self.stops))

    @property
    def stopped(self) -> bool:
        """Whether a stop string appeared: generation should end."""
        return self._matcher.stopped

    @property
    def matched(self) -> str | None:
        return self._matcher.matched

    def feed(self, token: int) -> str:
        if self.tokenizer.is_eog(token):
            return ""
        self.ids.append(int(token))
        return self._matcher.feed(self._new_text())

    def _new_text(self) -> str:
        dec = self.tokenizer.decode
        before = dec(self.ids[self._prefix : self._read])
        now = dec(self.ids[self._prefix :])
        if now.endswith("\ufffd") or len(now) <= len(before):  # an incomplete UTF-8 sequence: wait
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return now[len(before) :]

    def finish(self) -> str:
        tail = ""
        if self._read < len(self.ids):  # bytes that never completed a character: show them as decoded
            dec = self.tokenizer.decode
            tail = dec(self.ids[self._prefix :])[len(dec(self.ids[self._prefix : self._read])) :]
            self._prefix = self._read = len(self.ids)
        return self._matcher.feed(tail) + self._matcher.finish()
