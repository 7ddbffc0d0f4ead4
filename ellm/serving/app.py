"""The ASGI application: OpenAI's chat and text completions (streamed as server-sent events or whole),
models, health, Prometheus metrics and the chat page."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .metrics import CONTENT_TYPE, Metrics
from .protocol import ApiError, GenRequest, parse_request
from .scheduler import Job, Outcome, Piece, Scheduler

STATIC = Path(__file__).parent / "static"


@dataclass(frozen=True)
class ServeConfig:
    model_id: str
    api_key: str | None = None
    queue: int = 16  # requests waiting beyond the one running
    max_prompt_tokens: int | None = None  # None: the context size
    max_tokens: int | None = None  # the most a request may ask for (None: the context size)


def _error(e: ApiError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


async def _body(request: Request, limit: int) -> bytes:
    """The request body, refused (413) past `limit` bytes before it is all read."""
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise ApiError(413, f"the request body has {int(size)} bytes; this server takes at most {limit}")
    chunks, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise ApiError(413, f"the request body is over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def create_app(engine, cfg: ServeConfig, scheduler: Scheduler | None = None, speculative=None,
               cache_reuse: bool = True) -> Starlette:
    metrics = Metrics(slots=engine.n_slots)
    sched = scheduler or Scheduler(engine, metrics, cfg.queue, speculative=speculative, cache_reuse=cache_reuse)
    max_prompt = min(cfg.max_prompt_tokens or engine.ctx_size, engine.ctx_size)
    max_tokens = min(cfg.max_tokens or engine.ctx_size, engine.ctx_size)
    max_body = max(1 << 20, 64 * max_prompt)  # bytes: room for any prompt that fits, JSON escapes included
    created = int(time.time())

    def authorized(request: Request) -> None:
        if cfg.api_key is None:
            return
        got = request.headers.get("authorization", "")
        if not hmac.compare_digest(got.encode(), f"Bearer {cfg.api_key}".encode()):
            raise ApiError(401, "invalid API key (send it as 'Authorization: Bearer KEY')", kind="authentication_error",
                           code="invalid_api_key")

    async def completions(request: Request, chat: bool) -> Response:
        try:
            authorized(request)
            raw = await _body(request, max_body)
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError, RecursionError) as e:
                raise ApiError(400, f"the request body is not valid JSON: {str(e)[:200]}") from None
            req = await run_in_threadpool(parse_request, body, chat, engine.tokenizer, cfg.model_id, engine.ctx_size,
                                          max_prompt, max_tokens)
            job = sched.submit(req)
        except ApiError as e:
            if e.status not in (401, 503):
                metrics.count("errors")
            return _error(e)
        except Exception as e:  # a bug: one JSON answer, the server keeps serving
            metrics.count("errors")
            return _error(ApiError(500, f"internal error: {type(e).__name__}: {e}", kind="server_error"))
        if req.stream:
            return StreamingResponse(_stream(job, sched, cfg.model_id), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        return await _whole(job, sched, request, cfg.model_id)

    async def chat_completions(request: Request) -> Response:
        return await completions(request, chat=True)

    async def text_completions(request: Request) -> Response:
        return await completions(request, chat=False)

    async def models(request: Request) -> Response:
        try:
            authorized(request)
        except ApiError as e:
            return _error(e)
        return JSONResponse({"object": "list", "data": [
            {"id": cfg.model_id, "object": "model", "created": created, "owned_by": "ellm",
             "meta": {"ctx_size": engine.ctx_size, "slots": engine.n_slots, "target": engine.target,
                      "vocab_size": engine.config.vocab_size}}]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok", "queue_depth": sched.depth, "busy": sched.busy, "slots": engine.n_slots})

    async def prometheus(request: Request) -> Response:
        try:
            authorized(request)
        except ApiError as e:
            return _error(e)
        return Response(metrics.render(sched.busy), media_type=CONTENT_TYPE)

    async def page(request: Request) -> Response:
        return FileResponse(STATIC / "index.html", media_type="text/html")

    async def http_error(request: Request, exc: HTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return _error(ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", kind=kind))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        sched.start()
        try:
            yield
        finally:
            await run_in_threadpool(sched.close)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat_completions, methods=["POST"]),
            Route("/v1/completions", text_completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", prometheus, methods=["GET"]),
            Route("/", page, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error},
        lifespan=lifespan,
    )
    app.state.scheduler, app.state.metrics = sched, metrics
    return app


# --- answers -------------------------------------------------------------------------------------------

def _usage(out: Outcome) -> dict[str, Any]:
    return {"prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
            "total_tokens": out.prompt_tokens + out.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": out.cached_tokens}}


def _timings(out: Outcome) -> dict[str, Any]:
    """llama-server's names, which its clients and the chat page read."""
    computed = out.prompt_tokens - out.cached_tokens
    return {"prompt_n": computed, "prompt_cached": out.cached_tokens, "prompt_ms": 1e3 * out.prefill_s,
            "prompt_per_second": computed / out.prefill_s if out.prefill_s > 0 else None,
            "predicted_n": out.completion_tokens, "predicted_ms": 1e3 * out.decode_s,
            "predicted_per_second": out.decode_tokens / out.decode_s if out.decode_s > 0 else None,
            "ttft_ms": 1e3 * out.ttft_s, "queued_ms": 1e3 * out.queued_s, "slot": out.slot,
            "drafted": out.drafted, "accepted": out.accepted}


def _chat_logprobs(pieces: list[Piece], tokenizer) -> dict[str, Any]:
    def entry(tok: int, lp: float) -> dict[str, Any]:
        text = tokenizer.decode([tok])
        return {"token": text, "logprob": lp, "bytes": list(text.encode())}

    return {"content": [{**entry(p.token, p.logprob), "top_logprobs": [entry(t, lp) for t, lp in p.top or []]}
                        for p in pieces if p.logprob is not None]}


def _text_logprobs(pieces: list[Piece], tokenizer, at: int = 0) -> dict[str, Any]:
    """`at`: the offset of the first piece's text in the whole answer (streams send one piece at a time)."""
    scored = [p for p in pieces if p.logprob is not None]
    tokens = [tokenizer.decode([p.token]) for p in scored]
    offsets = []
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [p.logprob for p in scored],
            "top_logprobs": [{tokenizer.decode([t]): lp for t, lp in p.top or []} for p in scored],
            "text_offset": offsets}


async def _events(job: Job) -> AsyncIterator[tuple[str, Any]]:
    while True:
        kind, payload = await job.events.get()
        yield kind, payload
        if kind in ("done", "error", "cancelled"):
            return


async def _whole(job: Job, sched: Scheduler, request: Request, model_id: str) -> Response:
    """A non-streamed answer; a client that goes away cancels it."""
    req, tok = job.req, job.tokenizer
    pieces: list[Piece] = []
    watcher = asyncio.create_task(_watch_disconnect(request, job, sched))
    try:
        async for kind, payload in _events(job):
            if kind == "piece":
                pieces.append(payload)
            elif kind == "error":
                return _error(payload)
            elif kind == "cancelled":
                return Response(status_code=499)
            else:
                out: Outcome = payload
    finally:
        watcher.cancel()
        sched.cancel(job)  # a no-op for a finished job; stops one whose handler was cancelled (shutdown)
    text = "".join(p.text for p in pieces)
    ident = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    if req.chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text},
                  "logprobs": _chat_logprobs(pieces, tok) if req.logprobs is not None else None,
                  "finish_reason": out.finish_reason}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "finish_reason": out.finish_reason,
                  "logprobs": _text_logprobs(pieces, tok) if req.logprobs is not None else None}
        obj = "text_completion"
    body = {"id": ident, "object": obj, "created": int(time.time()), "model": model_id, "choices": [choice],
            "usage": _usage(out), "timings": _timings(out)}
    return JSONResponse(body, headers={"X-Ellm-Cached-Tokens": str(out.cached_tokens),
                                       "X-Ellm-Computed-Tokens": str(out.prompt_tokens - out.cached_tokens)})


async def _watch_disconnect(request: Request, job: Job, sched: Scheduler) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(0.05)
    sched.cancel(job)


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def _stream(job: Job, sched: Scheduler, model_id: str) -> AsyncIterator[str]:
    """Server-sent events: a chunk per piece of text, the finish reason, usage if asked, then [DONE]. A
    client that disconnects cancels the generator here, which cancels the job."""
    req: GenRequest = job.req
    ident = f"{'chatcmpl' if req.chat else 'cmpl'}-{uuid.uuid4().hex[:24]}"
    created = int(time.time())
    obj = "chat.completion.chunk" if req.chat else "text_completion"
    tok = job.tokenizer
    sent = 0  # characters of the answer sent so far (text completions' logprob offsets)

    def chunk(delta_text: str | None, finish: str | None, logprobs=None, extra=None) -> dict[str, Any]:
        if req.chat:
            delta = {} if delta_text is None else {"content": delta_text}
            choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        else:
            choice = {"index": 0, "text": delta_text or "", "logprobs": logprobs, "finish_reason": finish}
        return {"id": ident, "object": obj, "created": created, "model": model_id, "choices": [choice], **(extra or {})}

    try:
        if req.chat:
            yield _sse({**chunk(None, None), "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                          "logprobs": None, "finish_reason": None}]})
        async for kind, payload in _events(job):
            if kind == "piece":
                lp = None
                if req.logprobs is not None and payload.logprob is not None:
                    lp = _chat_logprobs([payload], tok) if req.chat else _text_logprobs([payload], tok, sent)
                if payload.text or lp is not None:
                    sent += len(payload.text)
                    yield _sse(chunk(payload.text, None, lp))
            elif kind == "error":
                yield _sse(payload.body())
                break
            elif kind == "cancelled":
                break
            else:
                out: Outcome = payload
                yield _sse(chunk(None if req.chat else "", out.finish_reason, extra={"timings": _timings(out)}))
                if req.include_usage:
                    yield _sse({"id": ident, "object": obj, "created": created, "model": model_id, "choices": [],
                                "usage": _usage(out)})
        yield "data: [DONE]\n\n"
    finally:
        sched.cancel(job)  # a no-op for a finished job; stops a running one whose client went away
