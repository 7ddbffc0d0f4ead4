"""One worker thread runs the batch-1 engine; requests wait in a bounded FIFO queue. Each request goes to the
KV slot that holds the longest part of its prompt (a conversation's next turn computes only its new
message), else to an empty or the least recently used slot. A cancelled request (its client went away) stops
before the engine's next step; one still queued never starts.

The event loop never waits on the engine: results travel to it through `loop.call_soon_threadsafe`.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from ..errors import EllmError
from ..runtime.textstream import TextStream
from .metrics import Metrics
from .protocol import ApiError, GenRequest


class Cancelled(Exception):
    """Raised inside the engine's callbacks to abandon a request whose client is gone."""


@dataclass
class Job:
    req: GenRequest
    loop: asyncio.AbstractEventLoop
    tokenizer: Any
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancelled: threading.Event = field(default_factory=threading.Event)
    id: int = 0
    enqueued: float = field(default_factory=time.perf_counter)

    def put(self, kind: str, payload: Any) -> None:
        """From the worker thread: hand an event to the request's coroutine."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))

    def cancel(self) -> None:
        self.cancelled.set()


@dataclass
class Piece:
    """Text released by one token, with its log-probabilities where asked."""

    text: str
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None


@dataclass
class Outcome:
    finish_reason: str  # stop | length
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    prefill_s: float
    decode_s: float
    ttft_s: float
    queued_s: float
    slot: int
    decode_tokens: int = 0
    drafted: int = 0
    accepted: int = 0


class Scheduler:
    def __init__(self, engine, metrics: Metrics, queue_size: int, speculative=None, cache_reuse: bool = True):
        self.engine = engine
        self.metrics = metrics
        self.queue_size = queue_size
        self.speculative = speculative
        self.cache_reuse = cache_reuse
        self._queue: collections.deque[Job] = collections.deque()
        self._cv = threading.Condition()
        self._ids = itertools.count(1)
        self._last_used = [0.0] * engine.n_slots
        self._busy = False
        self._closing = False
        self._mean_job_s = 1.0
        self._thread = threading.Thread(target=self._run, name="ellm-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        with self._cv:
            self._closing = True
            for job in self._queue:
                job.cancel()
            self._cv.notify_all()
        self._thread.join(timeout=30)

    @property
    def depth(self) -> int:
        return len(self._queue)

    @property
    def busy(self) -> bool:
        return self._busy

    def submit(self, req: GenRequest) -> Job:
        """Queue a request (from the event loop); ApiError 503 when the queue is full."""
        job = Job(req, asyncio.get_running_loop(), self.engine.tokenizer, id=next(self._ids))
        with self._cv:
            if len(self._queue) >= self.queue_size:
                self.metrics.rejected += 1
                wait = max(1, math.ceil(self._mean_job_s * (len(self._queue) + 1)))
                raise ApiError(503, f"the server is busy: {len(self._queue)} requests are waiting; retry later",
                               kind="server_error", code="queue_full", headers={"Retry-After": str(min(wait, 600))})
            self._queue.append(job)
            self.metrics.queue_depth = len(self._queue)
            self._cv.notify()
        return job

    # --- the worker thread --------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                job = self._queue.popleft()
                self.metrics.queue_depth = len(self._queue)
            if job.cancelled.is_set():
                self.metrics.cancelled += 1
                job.put("cancelled", None)
                continue
            self._busy = True
            t = time.perf_counter()
            try:
                job.put("done", self._serve(job))
            except Cancelled:
                self.metrics.cancelled += 1
                job.put("cancelled", None)
            except EllmError as e:
                job.put("error", ApiError(400, str(e)))
            except Exception as e:  # a bug: the request fails, the server keeps serving
                job.put("error", ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"))
            finally:
                self._busy = False
                self._mean_job_s = 0.8 * self._mean_job_s + 0.2 * (time.perf_counter() - t)

    def choose_slot(self, ids: list[int]) -> int:
        """The slot whose cached tokens are mostly a prefix of `ids` (the longest such), else an empty slot,
        else the least recently used."""
        eng = self.engine
        best, best_n = None, 0
        for i in range(eng.n_slots):
            cached = eng.slot_tokens(i)
            n = _common(cached, ids)
            if n > best_n and 2 * n >= len(cached):
                best, best_n = i, n
        if best is not None:
            return best
        empty = [i for i in range(eng.n_slots) if not eng.slot_tokens(i)]
        return empty[0] if empty else int(np.argmin(self._last_used))

    def _serve(self, job: Job) -> Outcome:
        req, eng = job.req, self.engine
        queued = time.perf_counter() - job.enqueued
        slot = self.choose_slot(req.ids)
        eng.select_slot(slot)
        self._last_used[slot] = time.monotonic()
        stream = TextStream(eng.tokenizer, req.stops)
        logprob_of = _logprob_fn(req.logprobs) if req.logprobs is not None else None
        pending: list[Piece] = []

        def on_logits(tok: int, row: np.ndarray) -> None:
            pending.append(Piece("", tok, *logprob_of(tok, row)))

        def on_token(tok: int) -> bool:
            if job.cancelled.is_set():
                raise Cancelled
            text = stream.feed(tok)
            piece = pending.pop() if pending else Piece("", tok)
            piece.text = text
            job.put("piece", piece)
            return stream.stopped

        def progress(done: int, total: int) -> None:
            if job.cancelled.is_set():
                raise Cancelled

        try:
            new = eng.generate(req.ids, req.max_tokens, sampling=req.sampling, on_token=on_token, progress=progress,
                         on_logits=on_logits if logprob_of else None, speculative=self.speculative,
                         cache_reuse=self.cache_reuse)
        finally:
            self._last_used[slot] = time.monotonic()
        tail = stream.finish()
        if tail:
            job.put("piece", Piece(tail, -1))
        st = eng.stats
        out = Outcome(
            finish_reason="length" if st.stop_reason in ("length", "context") else "stop",
            prompt_tokens=st.prompt_tokens, cached_tokens=st.reused_tokens,
            completion_tokens=len(new),
            prefill_s=st.prefill_s, decode_s=st.decode_s, ttft_s=st.ttft_s + queued, queued_s=queued, slot=slot,
            decode_tokens=st.decode_tokens, drafted=st.drafted, accepted=st.accepted)
        self.metrics.record(out)
        return out


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # the longest common prefix, by bisection over slice comparisons (fast in C)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _logprob_fn(top_n: int) -> Callable[[int, np.ndarray], tuple[float, list[tuple[int, float]]]]:
    """log softmax of the model's raw logits: the chosen token's and the top_n most likely."""

    def f(tok: int, row: np.ndarray):
        z = row.astype(np.float64)
        lse = z.max() + math.log(np.exp(z - z.max()).sum())
        top: list[tuple[int, float]] = []
        if top_n:
            idx = np.argpartition(-z, top_n - 1)[:top_n]
            idx = idx[np.argsort(-z[idx], kind="stable")]
            top = [(int(i), float(z[i] - lse)) for i in idx]
        return float(z[tok] - lse), top

    return f
