"""The server's counters, and `/metrics` in Prometheus' text exposition format (version 0.0.4)."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


@dataclass
class Metrics:
    slots: int = 1
    requests: int = 0  # answered, by outcome below
    errors: int = 0  # refused with a 4xx/5xx after parsing (bad request, engine error)
    rejected: int = 0  # 503: the queue was full
    cancelled: int = 0  # the client went away
    queue_depth: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens whose KV came from a slot's cache
    decode_tokens: int = 0  # generated tokens
    prefill_s: float = 0.0
    decode_s: float = 0.0
    ttft_s_sum: float = 0.0
    drafted: int = 0
    accepted: int = 0
    last_prefill_tok_s: float = 0.0
    last_decode_tok_s: float = 0.0
    last_ttft_s: float = 0.0
    last_cached_tokens: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def count(self, name: str) -> None:
        """One more of a counter (requests_*): from the event loop or the engine thread."""
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)

    def record(self, out) -> None:
        """A finished request (scheduler.Outcome)."""
        with self._lock:
            self.requests += 1
            self.prompt_tokens += out.prompt_tokens
            self.cached_tokens += out.cached_tokens
            self.decode_tokens += out.completion_tokens
            self.prefill_s += out.prefill_s
            self.decode_s += out.decode_s
            self.ttft_s_sum += out.ttft_s
            self.drafted += out.drafted
            self.accepted += out.accepted
            computed = out.prompt_tokens - out.cached_tokens
            self.last_prefill_tok_s = computed / out.prefill_s if out.prefill_s > 0 else 0.0
            self.last_decode_tok_s = out.decode_tokens / out.decode_s if out.decode_s > 0 else 0.0
            self.last_ttft_s = out.ttft_s
            self.last_cached_tokens = out.cached_tokens

    def render(self, busy: bool) -> str:
        with self._lock:
            rows = [
                ("requests_total", "counter", "requests answered", self.requests),
                ("requests_failed_total", "counter", "requests refused or failed after they were accepted", self.errors),
                ("requests_rejected_total", "counter", "requests refused with 503: the queue was full", self.rejected),
                ("requests_cancelled_total", "counter", "requests whose client went away", self.cancelled),
                ("queue_depth", "gauge", "requests waiting for the engine", self.queue_depth),
                ("busy", "gauge", "1 while the engine runs a request", int(busy)),
                ("slots", "gauge", "KV cache slots", self.slots),
                ("prompt_tokens_total", "counter", "prompt tokens of answered requests", self.prompt_tokens),
                ("prompt_tokens_cached_total", "counter", "prompt tokens whose KV a slot already held",
                 self.cached_tokens),
                ("prompt_tokens_computed_total", "counter", "prompt tokens computed by prefill",
                 self.prompt_tokens - self.cached_tokens),
                ("decode_tokens_total", "counter", "tokens generated", self.decode_tokens),
                ("prefill_seconds_total", "counter", "seconds in prefill", self.prefill_s),
                ("decode_seconds_total", "counter", "seconds decoding after the first token", self.decode_s),
                ("ttft_seconds_sum", "counter", "time to first token, queueing included, summed", self.ttft_s_sum),
                ("ttft_seconds_last", "gauge", "time to first token of the last request", self.last_ttft_s),
                ("prefill_tokens_per_second", "gauge", "prefill speed of the last request", self.last_prefill_tok_s),
                ("decode_tokens_per_second", "gauge", "decode speed of the last request", self.last_decode_tok_s),
                ("cached_tokens_last", "gauge", "prompt tokens the last request reused", self.last_cached_tokens),
                ("speculative_drafted_total", "counter", "drafted tokens verified", self.drafted),
                ("speculative_accepted_total", "counter", "drafted tokens accepted", self.accepted),
            ]
            if self.drafted:
                rows.append(("speculative_acceptance_ratio", "gauge", "accepted over drafted tokens",
                             self.accepted / self.drafted))
        lines = []
        for name, kind, help_, value in rows:
            lines += [f"# HELP ellm_{name} {help_}", f"# TYPE ellm_{name} {kind}", f"ellm_{name} {value:g}"
                      if isinstance(value, float) else f"ellm_{name} {value}"]
        return "\n".join(lines) + "\n"
