"""One worker thread runs the batch-1 engine; requests wait in a bounded FIFO queue. Each request goes to the
KV slot that holds the longest part of its prompt (a conversation's next turn computes only its new
message), else to an empty or the least recently used slot (`choose_slot`). A cancelled request (its client
went away) stops before the engine's next step; one still queued leaves the queue at once.

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
        """From any thread: hand an event to the request's coroutine."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))


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
        self._running: Job | None = None
        self._closing = False
        self._mean_job_s = 1.0
        self._thread = threading.Thread(target=self._run, name="ellm-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        """Stop: queued requests are answered as cancelled, the running one stops at its next step."""
        with self._cv:
            self._closing = True
            while self._queue:
                self._drop(self._queue.popleft())
            if self._running is not None:
                self._running.cancelled.set()
            self._cv.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout=30)

    def cancel(self, job: Job) -> None:
        """The client went away (from the event loop): a queued request leaves the queue at once, freeing its
        place; a running one stops before the engine's next step; a finished one is left alone."""
        with self._cv:
            job.cancelled.set()
            if job in self._queue:
                self._queue.remove(job)
                self.metrics.queue_depth = len(self._queue)
                self._drop(job)

    def _drop(self, job: Job) -> None:
        job.cancelled.set()
        self.metrics.count("cancelled")
        job.put("cancelled", None)

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
            if self._closing:
                raise ApiError(503, "the server is shutting down", kind="server_error", code="shutting_down")
            if len(self._queue) >= self.queue_size:
                self.metrics.count("rejected")
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
                job = self._running = self._queue.popleft()
                self.metrics.queue_depth = len(self._queue)
            self._busy = True
            t = time.perf_counter()
            try:
                job.put("done", self._serve(job))
            except Cancelled:
                self.metrics.count("cancelled")
                job.put("cancelled", None)
            except EllmError as e:
                self.metrics.count("errors")
                job.put("error", ApiError(400, str(e)))
            except Exception as e:  # a bug: the request fails, the server keeps serving
                self.metrics.count("errors")
                job.put("error", ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"))
            finally:
                with self._cv:
                    self._running = None
                self._busy = False
                self._mean_job_s = 0.8 * self._mean_job_s + 0.2 * (time.perf_counter() - t)

    def choose_slot(self, ids: list[int]) -> int:
        """Where a prompt runs: the slot whose whole cache it extends (the longest such: a conversation's next
        turn); else an empty slot; else the slot whose cache is 80% a prefix of it (the longest: a turn whose
        earlier answer tokenizes a little differently); else the least recently used. A shared system prompt
        alone does not take over another conversation's slot."""
        eng = self.engine
        common = [_common(eng.slot_tokens(i), ids) for i in range(eng.n_slots)]
        sizes = [len(eng.slot_tokens(i)) for i in range(eng.n_slots)]
        whole = [i for i in range(eng.n_slots) if sizes[i] and common[i] == sizes[i]]
        if whole:
            return max(whole, key=lambda i: common[i])
        empty = [i for i in range(eng.n_slots) if not sizes[i]]
        if empty:
            return empty[0]
        mostly = [i for i in range(eng.n_slots) if common[i] and 5 * common[i] >= 4 * sizes[i]]
        if mostly:
            return max(mostly, key=lambda i: common[i])
        return int(np.argmin(self._last_used))

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
            if stream.stopped or eng.tokenizer.is_eog(tok):  # a token whose text is never shown: no logprob
                piece.logprob, piece.top = None, None
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
