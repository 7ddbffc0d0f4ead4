"""OpenAI's request and error shapes: a request body checked field by field into a `GenRequest`, and every
refusal as an `ApiError` carrying its HTTP status. Anything eLLM does not support is refused by name,
never silently ignored."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import EllmError, one_line, quoted
from ..runtime.sampling import SamplingConfig
from ..runtime.textstream import check_stops

# fields a client may send that change nothing about the answer
_METADATA = {"user", "metadata", "store", "service_tier"}
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "presence_penalty",
           "frequency_penalty", "repeat_penalty", "repeat_last_n", "logprobs", "n", "stream", "stream_options"}
# features eLLM does not have, accepted only at the value that asks for nothing (clients send these)
_NEUTRAL = {"tools": ([], None), "tool_choice": ("none", None), "logit_bias": ({}, None),
            "response_format": ({"type": "text"}, None), "parallel_tool_calls": (True, False, None)}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs"} | _METADATA
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "best_of", "suffix"} | _METADATA
MAX_TOP_LOGPROBS = 20


class ApiError(Exception):
    """A refusal in OpenAI's error shape."""

    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        message = one_line(message)  # as EllmError's: a client's value may hold newlines
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


@dataclass
class GenRequest:
    """One checked request: what to generate and how to answer."""

    chat: bool
    model: str
    ids: list[int]
    max_tokens: int
    sampling: SamplingConfig
    stops: tuple[str, ...] = ()
    stream: bool = False
    include_usage: bool = False
    logprobs: int | None = None  # None: off; else how many alternatives per token (0: only the chosen)
    messages: list[dict[str, str]] = field(default_factory=list)


def _shown(key: str) -> str:
    """A client's key in a message: as sent when it is a plain name, quoted and cut short otherwise."""
    return key if key.isidentifier() and len(key) <= 40 else quoted(key)


def _names(keys: list[str]) -> str:
    """Sorted client keys in a message: the first five shown, the rest counted."""
    return ", ".join(map(_shown, keys[:5])) + (f" and {len(keys) - 5} more" if len(keys) > 5 else "")


def _number(body: dict, key: str, default, lo=-math.inf, hi=math.inf, integer=False):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (integer and not isinstance(v, int)):
        raise bad(f"'{key}' must be {'an integer' if integer else 'a number'}, got {quoted(v)}", key)
    if isinstance(v, int) and not -2**63 <= v < 2**63:  # JSON integers are unbounded; floats overflow past 1e308
        raise bad(f"'{key}' is out of range", key)
    if not (math.isfinite(v) and lo <= v <= hi):
        raise bad(f"'{key}' must be between {lo} and {hi}, got {v!r}", key)
    return v


def _content(m: Any, i: int) -> dict[str, str]:
    if not isinstance(m, dict):
        raise bad(f"messages[{i}] must be an object", "messages")
    role = m.get("role")
    if role not in ("system", "user", "assistant", "developer"):
        raise bad(f"messages[{i}].role {quoted(role)} is not supported (system, user, assistant)", "messages")
    unsupported = set(m) - {"role", "content", "name"}
    if unsupported:
        raise bad(f"messages[{i}] has unsupported fields: {_names(sorted(unsupported))}", "messages")
    c = m.get("content")
    if isinstance(c, list):  # content parts: text only
        texts = []
        for part in c:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad(f"messages[{i}].content: only text parts are supported", "messages")
            texts.append(part["text"])
        c = "".join(texts)
    if not isinstance(c, str):
        raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")
    return {"role": "system" if role == "developer" else role, "content": c}


def parse_request(body: Any, chat: bool, tokenizer, model_id: str, ctx_size: int, max_prompt: int,
                  max_tokens_limit: int) -> GenRequest:
    """Check a request body and tokenize its prompt; ApiError (400, or 404 for another model) otherwise."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    allowed = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for key, neutral in _NEUTRAL.items():
        if key in body and (chat or key == "logit_bias"):
            if body[key] not in neutral:
                raise bad(f"'{key}' is not supported by this server", key)
            allowed = allowed | {key}
    unknown = sorted(set(body) - allowed)
    if unknown:
        raise bad(f"unsupported parameter{'s' if len(unknown) > 1 else ''}: {_names(unknown)}", _shown(unknown[0]))
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad("'model' is required", "model")
    if model != model_id:
        raise ApiError(404, f"the model {quoted(model)} does not exist; this server serves {model_id!r}", "model",
                       code="model_not_found")
    if _number(body, "n", 1, integer=True) != 1:
        raise bad("only n=1 is supported", "n")
    if not chat:
        if body.get("echo") not in (None, False):
            raise bad("'echo' is not supported", "echo")
        if body.get("best_of") not in (None, 1):
            raise bad("only best_of=1 is supported", "best_of")
        if body.get("suffix") not in (None, ""):
            raise bad("'suffix' is not supported", "suffix")

    sampling = _sampling(body)
    stop = body.get("stop")
    try:
        stops = check_stops([stop] if isinstance(stop, str) else (stop or []))
    except (EllmError, TypeError) as e:
        raise bad(f"'stop': {e}", "stop") from None
    logprobs = _logprobs(body, chat)

    messages: list[dict[str, str]] = []
    try:
        if chat:
            raw = body.get("messages")
            if not isinstance(raw, list) or not raw:
                raise bad("'messages' must be a non-empty list", "messages")
            messages = [_content(m, i) for i, m in enumerate(raw)]
            ids = tokenizer.encode_chat(messages)
        else:
            ids = _prompt_ids(body.get("prompt"), tokenizer)
    except ApiError:
        raise
    except Exception as e:  # a template that fails on these messages (jinja raises more than TemplateError)
        raise bad(f"the prompt could not be built: {e}", "messages" if chat else "prompt") from None
    if not ids:
        raise bad("the prompt is empty", "prompt")
    if len(ids) > max_prompt:
        limit = (f"the context holds {ctx_size}" if max_prompt >= ctx_size
                 else f"this server takes at most {max_prompt} (--max-prompt-tokens)")
        raise bad(f"the prompt has {len(ids)} tokens, but {limit}", "messages" if chat else "prompt",
                  code="context_length_exceeded")

    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    room = ctx_size - len(ids)
    max_tokens = _number(body, key, None, lo=1, integer=True)
    if max_tokens is not None and max_tokens > max_tokens_limit:
        raise bad(f"'{key}' is {max_tokens}, more than this server's limit of {max_tokens_limit}", key)
    if room < 1 or (max_tokens is not None and max_tokens > room):
        raise bad(f"the prompt has {len(ids)} tokens and asks for {max_tokens or 1} more, but the context holds "
                  f"{ctx_size}", key, code="context_length_exceeded")
    opts = body.get("stream_options")
    if opts is not None and (not isinstance(opts, dict) or set(opts) - {"include_usage"}):
        raise bad("'stream_options' supports only include_usage", "stream_options")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise bad("'stream' must be true or false", "stream")
    return GenRequest(chat=chat, model=model, ids=ids, max_tokens=min(max_tokens or room, max_tokens_limit, room),
                      sampling=sampling, stops=stops, stream=stream,
                      include_usage=bool((opts or {}).get("include_usage")), logprobs=logprobs, messages=messages)


def _sampling(body: dict) -> SamplingConfig:
    kw = dict(
        temperature=_number(body, "temperature", 1.0, 0, 2),
        top_p=_number(body, "top_p", 1.0, 0, 1),
        top_k=_number(body, "top_k", 0, 0, integer=True),
        min_p=_number(body, "min_p", 0.0, 0, 1),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2, 2),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2, 2),
        repeat_penalty=_number(body, "repeat_penalty", 1.0, 0, 10),
        penalty_last_n=_number(body, "repeat_last_n", 64, -1, integer=True),
        seed=_number(body, "seed", None, integer=True),
    )
    if kw["top_p"] == 0:
        kw["top_p"] = 1e-9  # OpenAI allows 0: only the most likely token
    try:
        return SamplingConfig(**kw)
    except EllmError as e:
        raise bad(str(e)) from None


def _logprobs(body: dict, chat: bool) -> int | None:
    if chat:
        on = body.get("logprobs")
        if on not in (None, True, False):
            raise bad("'logprobs' must be true or false", "logprobs")
        top = _number(body, "top_logprobs", None, 0, MAX_TOP_LOGPROBS, integer=True)
        if top is not None and not on:
            raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        return (top or 0) if on else None
    n = _number(body, "logprobs", None, 0, MAX_TOP_LOGPROBS - 1, integer=True)
    return n


def _prompt_ids(prompt: Any, tokenizer) -> list[int]:
    """A completion prompt: a string, a list of one string, or a list of token ids."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        if not all(0 <= t < tokenizer.vocab_size for t in prompt):
            raise bad(f"token ids must be in [0, {tokenizer.vocab_size})", "prompt")
        return list(prompt)
    raise bad("'prompt' must be a string, a list of one string, or a list of token ids", "prompt")
