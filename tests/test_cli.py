"""The CLI contract: `ellm run --json`, prompt files, `ellm demo`."""

from __future__ import annotations

import json
import subprocess
import sys


def ellm(*args, env=None, timeout=900):
    return subprocess.run([sys.executable, "-m", "ellm", *map(str, args)], capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_run_json(artifact):
    p = ellm("run", artifact, "-p", "The capital of France is", "-n", "8", "--json", "--threads", "2", "--ctx-size", "256")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert {"text", "tokens", "prompt_tokens", "ttft_s", "prefill_tok_s", "decode_tok_s"} <= set(out)
    assert out["prompt_tokens"] == 5 and 1 <= len(out["tokens"]) <= 8
    assert out["ttft_s"] > 0 and out["decode_tok_s"] > 0


def test_run_chat_from_file(artifact, tmp_path):
    f = tmp_path / "q.txt"
    f.write_text("What is 2 + 2?")
    p = ellm("run", artifact, "-f", f, "--chat", "-n", "16", "--json", "--ctx-size", "256")
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["prompt_tokens"] > 20  # the template's system prompt is included
    assert "4" in out["text"]


def test_demo(tmp_path):
    import os

    from ellm.demo import cache_root

    # a fresh artifact cache, sharing the sensitivity tables: the default compile's analysis runs once per model
    # in the whole suite (tests/test_precision_plan.py covers its caching)
    shared = cache_root() / "sensitivity"
    shared.mkdir(parents=True, exist_ok=True)
    (tmp_path / "sensitivity").symlink_to(shared)
    env = dict(os.environ, ELLM_CACHE=str(tmp_path))
    p = ellm("demo", "-n", "8", env=env, timeout=1800)  # the first compile of a suite runs the analysis (~4 min alone)
    assert p.returncode == 0, p.stderr
    assert "prefill:" in p.stdout and "tokens/s" in p.stdout
    again = ellm("demo", "-n", "4", env=env)
    assert "using cached artifact" in again.stderr
