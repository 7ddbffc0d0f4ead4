"""Structured fuzzing of the artifact loader (hypothesis): a small compiled artifact whose manifest has a value
deleted, replaced or nudged anywhere in its tree (then sealed again, as someone without the fleet key could, to
reach the checks beneath the digest; or left unsealed), and whose files are truncated, flipped, removed or made
symlinks. Every case loads or is refused with one line (fuzzing.outcome); a sample of the refusals goes through
`ellm run`: exit status 2 and the same line."""

from __future__ import annotations

import json
import math
import shutil
from collections import Counter
from pathlib import Path

import pytest
from fuzzing import EXPLORE, assert_cli_refuses, outcome
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from synthetic import write_model

import ellm
from ellm.runtime.envelope import envelope

CASES = 2_000 * (10 if EXPLORE else 1)
CLI_SAMPLES = 6
FILES = ["manifest.json", "manifest.digest", "weights.bin", "tokenizer.json"]  # + the kernels file(s)

INTS = st.sampled_from([0, 1, -1, 2, 4095, 4096, 4097, 1 << 31, 1 << 32, 1 << 62, 1 << 63, 1 << 64]) | st.integers()
NAMES = st.sampled_from(["", ".", "..", "../weights.bin", "/etc/passwd", "weights.bin", "tokenizer.json",
                         "manifest.json", "a/b", "x" * 300, "nul\0name", "float16", "int99", "znver3"])
JSON = st.recursive(st.none() | st.booleans() | INTS | st.floats() | st.text(max_size=8) | NAMES,
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                    max_leaves=6)


@st.composite
def edited(draw, manifest: dict) -> tuple[dict, str]:
    """A copy of `manifest` with one node (reached by a random walk from the top) deleted, replaced or nudged."""
    m = json.loads(json.dumps(manifest))
    parent, key, node = None, None, m
    while isinstance(node, (dict, list)) and node and (parent is None or draw(st.integers(0, 3))):
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        parent, key = node, draw(st.sampled_from(keys))
        node = parent[key]
    if parent is None:
        return draw(JSON), "manifest replaced"
    how = draw(st.sampled_from(["delete", "replace", "nudge", "rename"]))
    if how == "delete":
        del parent[key]
    elif how == "rename" and isinstance(parent, dict):
        parent[draw(st.text(max_size=8) | st.sampled_from(sorted(parent)))] = parent.pop(key)
    elif how == "nudge" and isinstance(node, int) and not isinstance(node, bool):
        parent[key] = draw(st.sampled_from([node + 1, node - 1, -node, 2 * node, node + 4096, node * 1000]))
    elif how == "nudge" and isinstance(node, str):
        parent[key] = draw(NAMES | st.sampled_from([node[:-1], node + "0", node.upper()]))
    elif how == "nudge" and isinstance(node, list):
        parent[key] = draw(st.sampled_from([node[:-1], node + node[-1:], node[::-1], []]))
    else:
        parent[key] = draw(JSON)
    return m, f"{how} {key!r}"


@st.composite
def damaged(draw, good: Path, manifest: dict) -> list:
    """Edits to apply to a fresh copy: ("manifest", dict, reseal) and/or file damage."""
    ops = []
    if draw(st.integers(0, 4)):
        m, what = draw(edited(manifest))
        ops.append(("manifest", m, draw(st.integers(0, 5)) > 0, what))
    files = FILES + [t["kernels_file"] for t in manifest["targets"]]
    for _ in range(draw(st.integers(0 if ops else 1, 2))):
        name = draw(st.sampled_from(files))
        size = (good / name).stat().st_size
        how = draw(st.sampled_from(["truncate", "flip", "remove", "symlink", "garbage", "extra"]))
        ops.append((how, name, draw(st.integers(0, max(0, size - 1))), draw(st.integers(1, 255))))
    return ops


def apply(case: Path, ops: list) -> None:
    for op in ops:
        if op[0] == "manifest":
            _, m, reseal, _ = op
            raw = json.dumps(m).encode() if isinstance(m, dict) else json.dumps(m, default=str).encode()
            (case / "manifest.json").write_bytes(raw)
            if reseal:
                (case / "manifest.digest").write_text(envelope(raw))
            continue
        how, name, at, byte = op
        f = case / name
        if not f.is_file() or f.is_symlink():
            continue
        if how == "truncate":
            with open(f, "r+b") as h:
                h.truncate(at)
        elif how == "flip":
            data = bytearray(f.read_bytes())
            if data:
                data[at % len(data)] ^= byte
                f.write_bytes(bytes(data))
        elif how == "remove":
            f.unlink()
        elif how == "symlink":
            real = case.parent / f"{case.name}-{name}.real"
            shutil.move(f, real)
            f.symlink_to(real)
        elif how == "garbage":
            f.write_bytes(bytes([byte]) * (at % 4096))
        elif how == "extra":
            (case / f"extra-{byte}.bin").write_bytes(b"x")


def load(path: Path) -> None:
    """All that `ellm run` does before its first kernel call: open, verify, choose a target, check the context,
    build the tokenizer, load the kernels, map and check every parameter, allocate the KV cache."""
    ellm.load(path, threads=1, ctx_size=64)


@pytest.fixture(scope="module")
def good(tmp_path_factory) -> Path:
    from ellm.compiler.build import CompileOptions, compile_model

    d = tmp_path_factory.mktemp("fuzz-artifact")
    out = d / "good"
    compile_model(write_model(d / "tiny.gguf"), out, CompileOptions(target="auto"))
    load(out)
    return out


def test_the_fuzzed_artifact_loader_loads_or_refuses_in_one_line(good, tmp_path):
    manifest = json.loads((good / "manifest.json").read_text())
    tally: Counter = Counter()
    refusals: dict[str, tuple[list, str]] = {}
    case = tmp_path / "case"

    @settings(max_examples=CASES, derandomize=not EXPLORE, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(damaged(good, manifest))
    def one(ops):
        shutil.rmtree(case, ignore_errors=True)
        for leftover in tmp_path.glob("case-*.real"):
            leftover.unlink()
        shutil.copytree(good, case)
        apply(case, ops)
        msg = outcome(lambda: load(case), tally)
        if msg is not None:
            kind = ops[-1][0] if ops[-1][0] != "manifest" else ops[-1][3].split()[0]
            refusals.setdefault(kind, (ops, msg))

    one()
    assert tally["cases"] >= CASES and tally["refused"] >= CASES // 2 and tally["loaded"] > 0, tally
    picks = sorted(refusals.items())[:: max(1, math.ceil(len(refusals) / CLI_SAMPLES))]
    for i, (_, (ops, msg)) in enumerate(picks):
        art = tmp_path / f"cli{i}"
        shutil.copytree(good, art)
        apply(art, ops)
        assert_cli_refuses(["run", str(art), "-p", "hi", "-n", "1", "--ctx-size", "64", "--threads", "1"],
                           msg.replace(str(case), str(art)))
