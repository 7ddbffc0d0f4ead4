"""Structured fuzzing of the server's request parser (hypothesis): valid chat and completion bodies with a value
anywhere in them replaced by random JSON, a field dropped or an unknown one added, and random bodies. Every case
is a checked GenRequest or an ApiError with a 4xx status and a one-line message; any other exception is what the
server would answer with a 500."""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest
from fuzzing import EXPLORE, no_hang
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from synthetic import write_model

from ellm.compiler.gguf_file import GGUFFile
from ellm.runtime.tokenizer import Tokenizer
from ellm.serving.protocol import ApiError, GenRequest, parse_request

CASES = 3_000 * (10 if EXPLORE else 1)
MODEL, CTX, MAX_PROMPT, MAX_TOKENS = "m", 256, 200, 64

CHAT = {"model": MODEL, "messages": [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "max_tokens": 8, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "min_p": 0.05, "seed": 1, "stop": ["\n", "."],
        "logprobs": True, "top_logprobs": 2, "stream": True, "stream_options": {"include_usage": True},
        "presence_penalty": 0.5, "frequency_penalty": 0.1, "repeat_penalty": 1.1, "repeat_last_n": 32, "n": 1,
        "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "user": "u"}
COMPLETION = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0, "logprobs": 3,
              "echo": False, "best_of": 1, "suffix": "", "stop": "\n", "seed": 7, "stream": False}

NUMBERS = (st.sampled_from([0, 1, -1, 2, 20, 21, 64, 65, 255, 256, 257, 1 << 31, 1 << 63, 1 << 64, -(1 << 63)])
           | st.integers() | st.floats() | st.sampled_from([math.nan, math.inf, -math.inf, 1e308, -0.0, 0.5, 2.5]))
TEXT = st.text(max_size=12) | st.sampled_from(["", "m", "user", "assistant", "tool", "text", "image_url", "none",
                                              "include_usage", "<|im_end|>", "\0", "x" * 5000])
JSON = st.recursive(st.none() | st.booleans() | NUMBERS | TEXT,
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(TEXT, c, max_size=4), max_leaves=8)
KEYS = st.sampled_from(sorted({*CHAT, *COMPLETION, "max_completion_tokens", "logit_bias", "parallel_tool_calls",
                               "functions", "role", "content", "type", "text", "include_usage"})) | TEXT


@st.composite
def edited(draw, body: dict) -> dict:
    """A copy of `body` with 1-3 nodes (each reached by a random walk from the top) replaced, dropped or added."""
    b = json.loads(json.dumps(body))
    for _ in range(draw(st.integers(1, 3))):
        parent, key, node = None, None, b
        while isinstance(node, (dict, list)) and node and draw(st.booleans()):
            parent, key = node, draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
            node = node[key]
        how = draw(st.sampled_from(["replace", "drop", "add"]))
        if how == "add" and isinstance(node, dict):
            node[draw(KEYS)] = draw(JSON)
        elif how == "drop" and parent is not None:
            del parent[key]
        elif parent is not None:
            parent[key] = draw(JSON)
    return b


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp("req") / "m.gguf", n_layers=1, d=64, ff=128, heads=2, kv_heads=1,
                       vocab=320)
    return Tokenizer.from_gguf(GGUFFile(path))


def _check(body, chat: bool, tokenizer, tally: Counter) -> None:
    tally["cases"] += 1
    try:
        with no_hang():
            req = parse_request(body, chat, tokenizer, MODEL, CTX, MAX_PROMPT, MAX_TOKENS)
    except ApiError as e:
        assert e.status in (400, 404) and e.message and "\n" not in e.message, (e.status, e.message)
        assert len(e.message) < 400, e.message[:400]  # a client's value is quoted short, not echoed whole
        json.dumps(e.body(), allow_nan=False)
        tally["refused"] += 1
        return
    assert isinstance(req, GenRequest) and req.chat == chat and isinstance(req.stream, bool)
    assert 0 < len(req.ids) <= MAX_PROMPT and all(0 <= t < tokenizer.vocab_size for t in req.ids)
    assert 1 <= req.max_tokens <= min(MAX_TOKENS, CTX - len(req.ids))
    s = req.sampling
    assert all(math.isfinite(v) for v in (s.temperature, s.top_p, s.min_p, s.repeat_penalty))
    assert req.logprobs is None or 0 <= req.logprobs <= 20
    tally["accepted"] += 1


def test_the_request_parser_accepts_or_refuses_with_a_4xx(tokenizer):
    tally: Counter = Counter()
    for base in (CHAT, COMPLETION):  # the unedited bodies are accepted
        _check(base, base is CHAT, tokenizer, tally)
    assert tally["accepted"] == 2

    @settings(max_examples=CASES, derandomize=not EXPLORE, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.data())
    def case(data):
        chat = data.draw(st.booleans())
        body = data.draw(edited(CHAT if chat else COMPLETION) | JSON if data.draw(st.integers(0, 9)) == 0
                         else edited(CHAT if chat else COMPLETION))
        _check(body, chat, tokenizer, tally)

    case()
    assert tally["cases"] >= CASES and tally["accepted"] >= CASES // 20 and tally["refused"] >= CASES // 2, tally
