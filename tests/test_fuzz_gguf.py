"""Structured fuzzing of the GGUF loader (hypothesis): a real small model's file taken apart (gguf_mutate.Spec)
and made wrong in its header, metadata types and values, counts, tensor dimensions, types and offsets, or its
bytes truncated and flipped. Every case loads or is refused with one line (fuzzing.outcome); a sample of the
refusals goes through the CLI: exit status 2 and the same line."""

from __future__ import annotations

import copy
import math
from collections import Counter

import pytest
from fuzzing import EXPLORE, assert_cli_refuses, outcome
from gguf_mutate import Spec, encode, spec_of
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from synthetic import write_model

from ellm.compiler.source_model import open_model

CASES = 5_000 * (10 if EXPLORE else 1)
CLI_SAMPLES = 6

INTS = st.sampled_from([0, 1, 2, 3, 7, 31, 32, 33, 64, 255, 1 << 15, (1 << 31) - 1, 1 << 31, (1 << 32) - 1, 1 << 32,
                        (1 << 63) - 1, 1 << 63, (1 << 64) - 1, -1, -2]) | st.integers(-(1 << 64), 1 << 64)
FLOATS = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([0.0, -0.0, 1e-30, 1e30, -1.0])
STRINGS = st.text(max_size=24) | st.binary(max_size=12) | st.sampled_from(["", "llama", "gpt2", "a b", "a  b", " "])
TYPES = st.sampled_from(list(range(13))) | st.sampled_from([13, 255, (1 << 32) - 1])


def value_of(t: int, elem: int | None):
    if t == 8:
        return STRINGS
    if t in (6, 12):
        return FLOATS
    if t == 9:
        return st.lists(value_of(elem, None) if elem is not None and elem != 9 else INTS, max_size=6)
    return INTS


@st.composite
def mutated(draw, good: Spec) -> tuple[bytes, list[str]]:
    s = copy.deepcopy(good)
    done = []
    for _ in range(draw(st.integers(1, 3))):
        op = draw(st.sampled_from(["value", "type", "element", "drop", "twice", "rename", "dims", "ndims", "ttype",
                                   "offset", "tdrop", "tname", "counts", "version", "alignment"]))
        done.append(op)
        if op in ("value", "type", "element", "drop", "twice", "rename") and s.fields:
            i = draw(st.integers(0, len(s.fields) - 1))
            key, t, elem, value = s.fields[i]
            if op == "value":
                if t == 9 and isinstance(value, list) and value and draw(st.booleans()):
                    value = list(value)
                    j = draw(st.integers(0, len(value) - 1))
                    value[j] = draw(value_of(elem, None))  # one token, merge or score
                    if draw(st.booleans()):
                        value = value[: draw(st.integers(0, len(value)))]
                else:
                    value = draw(value_of(t, elem))
                s.fields[i] = (key, t, elem, value)
            elif op == "type":
                t = draw(TYPES)
                elem = draw(TYPES) if t == 9 else None
                s.fields[i] = (key, t, elem, draw(value_of(t, elem)) if draw(st.booleans()) else value)
            elif op == "element" and t == 9:
                s.fields[i] = (key, t, draw(TYPES), value)
            elif op == "drop":
                del s.fields[i]
            elif op == "twice":
                s.fields.insert(draw(st.integers(0, len(s.fields))), s.fields[i])
            elif op == "rename":
                s.fields[i] = (draw(st.sampled_from([f[0] for f in s.fields]) | STRINGS), t, elem, value)
        elif op in ("dims", "ndims", "ttype", "offset", "tdrop", "tname") and s.tensors:
            i = draw(st.integers(0, len(s.tensors) - 1))
            name, dims, type_id, offset = s.tensors[i]
            if op == "dims" and dims:
                dims = list(dims)
                dims[draw(st.integers(0, len(dims) - 1))] = draw(INTS)
            elif op == "ndims":
                dims = (list(dims) + [1, 1, 1, 1, 1])[: draw(st.integers(0, 5))]
            elif op == "ttype":
                type_id = draw(st.integers(0, 41) | st.sampled_from([1 << 31, (1 << 32) - 1]))
            elif op == "offset":
                others = [t[3] for t in s.tensors]
                offset = draw(st.sampled_from(others) | INTS | st.integers(0, len(s.data)))
            elif op == "tname":
                name = draw(st.sampled_from([t[0] for t in s.tensors]) | STRINGS)
            if op == "tdrop":
                del s.tensors[i]
            else:
                s.tensors[i] = (name, dims, type_id, offset)
        elif op == "counts":
            s.n_kv = len(s.fields) + draw(st.integers(-3, 3) | INTS)
            s.n_tensors = len(s.tensors) + draw(st.integers(-3, 3))
        elif op == "version":
            s.version = draw(st.sampled_from([0, 1, 2, 4, 3 << 24, (1 << 32) - 1]))
        elif op == "alignment":
            a = draw(st.sampled_from([0, 1, 3, 16, 64, 4096, 1 << 31]))
            s.fields.append(("general.alignment", 4, None, a))
            s.alignment = a if a > 0 and not a & (a - 1) and a < 1 << 20 else s.alignment
    raw = bytearray(encode(s))
    for _ in range(draw(st.integers(0, 2))):  # bytes flipped anywhere
        done.append("flip")
        raw[draw(st.integers(0, len(raw) - 1))] ^= draw(st.integers(1, 255))
    if draw(st.integers(0, 9)) == 0:
        done.append("truncate")
        raw = raw[: draw(st.integers(0, len(raw)))]
    return bytes(raw), done


def load(path) -> None:
    """What `ellm compile` and `ellm inspect` read before any weight is packed: header, tensor table, config,
    tokenizer (its chat template rendered), graph with every weight's format checked."""
    tok = open_model(path).tokenizer
    if tok.info.chat_template:
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = write_model(tmp_path_factory.mktemp("fuzz") / "good.gguf", n_layers=1, d=64, ff=128, heads=2, kv_heads=1,
                       vocab=320)
    load(path)
    return spec_of(path)


def test_the_fuzzed_gguf_loader_loads_or_refuses_in_one_line(good, tmp_path):
    tally: Counter = Counter()
    refusals: dict[str, tuple[bytes, str]] = {}  # a sample for the CLI: one per kind of first mutation
    path = tmp_path / "case.gguf"

    @settings(max_examples=CASES, derandomize=not EXPLORE, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(mutated(good))
    def case(m):
        raw, ops = m
        path.write_bytes(raw)
        msg = outcome(lambda: load(path), tally)
        if msg is not None:
            tally[f"refused after {ops[-1]}"] += 1
            refusals.setdefault(ops[-1], (raw, msg))

    case()
    assert tally["cases"] >= CASES and tally["refused"] >= CASES // 2, tally
    assert tally["loaded"] > 0, tally  # some mutations are harmless: the loader is not refusing everything
    picks = sorted(refusals.items())[:: max(1, math.ceil(len(refusals) / CLI_SAMPLES))]
    for i, (_, (raw, msg)) in enumerate(picks):
        bad = tmp_path / f"cli{i}.gguf"
        bad.write_bytes(raw)
        assert_cli_refuses(["inspect", str(bad)], msg.replace(str(path), str(bad)))
