"""The CLI contract: `ellm run --json`, prompt files, `ellm demo`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest


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


def test_run_speculative_with_a_prompt_cache(artifact, tmp_path):
    """Speculation's statistics in --json; a prompt cache that the next run extends; a corrupt one refused with
    one line and exit status 2, the file left as it was."""
    cache = tmp_path / "session.kv"
    # no trailing space: after one, greedy output on some CPUs leaves the pattern (and prompt lookup finds nothing)
    prompt = ("one two three four five six seven eight nine ten " * 6).strip()
    args = ["-n", "24", "--json", "--threads", "2", "--ctx-size", "512", "--prompt-cache", cache]
    p = ellm("run", artifact, "-p", prompt, "--speculative-chain", "8", *args)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert {"accept_rate", "mean_accepted", "verify_steps", "reused_tokens"} <= set(out)
    assert out["verify_steps"] > 0 and out["reused_tokens"] == 0 and cache.is_file()
    again = ellm("run", artifact, "-p", prompt + " eleven twelve", *args)
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["reused_tokens"] == out["prompt_tokens"]  # the new words follow whole tokens
    blob = bytearray(cache.read_bytes())
    blob[len(blob) // 2] ^= 0x55
    cache.write_bytes(bytes(blob))
    bad = ellm("run", artifact, "-p", prompt, *args)
    assert bad.returncode == 2
    lines = bad.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: prompt cache") and "checksum" in lines[0]
    assert cache.read_bytes() == bytes(blob)


def _demo_cache(tmp_path, monkeypatch):
    """ELLM_CACHE set to a fresh `tmp_path` (here and for `ellm` subprocesses) and where the demo looks there
    for its compiled model: (environment, that directory)."""
    from ellm.demo import cache_root, demo_artifact_dir
    from ellm.fsutil import sha256_file
    from ellm.models import default_model_path
    from ellm.targets import resolve_target

    monkeypatch.setenv("ELLM_CACHE", str(tmp_path))
    assert cache_root() == tmp_path
    return dict(os.environ), demo_artifact_dir(sha256_file(default_model_path()), resolve_target("auto").name)


def test_demo_answers_from_the_cached_artifact(tmp_path, artifact, monkeypatch):
    """`ellm demo` on a warm cache: the answer and the speeds, no compile. (The cold first run compiles the default
    model with the sensitivity analysis, ~10 min on 2 Zen 3 cores: `make test-slow` runs it.)"""
    env, out = _demo_cache(tmp_path, monkeypatch)
    out.symlink_to(artifact, target_is_directory=True)
    p = ellm("demo", "-n", "8", env=env)
    assert p.returncode == 0, p.stderr
    assert f"using cached artifact {out}" in p.stderr and "compiling" not in p.stderr
    assert "question: Is the software provided with a warranty?" in p.stdout
    assert "prefill:" in p.stdout and "tokens/s" in p.stdout


def test_demo_compiles_the_default_model_with_the_default_options_once(tmp_path, artifact, monkeypatch):
    """A cold cache compiles the bundled model with every option at its default for this host's target; an
    artifact of another model in its place is compiled again. (compile_model itself is the one `ellm compile` runs.)"""
    from types import SimpleNamespace

    import ellm.compiler.build as build
    from ellm.compiler.build import CompileOptions
    from ellm.demo import cached_artifact
    from ellm.models import default_model_path
    from ellm.targets import resolve_target

    _, out = _demo_cache(tmp_path, monkeypatch)
    calls = []

    def compile_model(model, dest, options, force=False, log=print):
        calls.append((model, dest, options, force))
        shutil.copytree(artifact, dest, dirs_exist_ok=True)
        return SimpleNamespace(seconds=1.0, artifact_bytes=1, kernels=1)

    monkeypatch.setattr(build, "compile_model", compile_model)
    logs: list[str] = []
    assert cached_artifact("auto", logs.append) == out == cached_artifact("auto", logs.append)
    preset = resolve_target("auto").name
    assert calls == [(default_model_path(), out, CompileOptions(target=preset), True)]
    assert logs[0].startswith("compiling ") and logs[-1] == f"using cached artifact {out}"
    manifest = out / "manifest.json"
    m = json.loads(manifest.read_text())
    m["source"]["sha256"] = "0" * 64  # another model's artifact under this name
    manifest.write_text(json.dumps(m))
    cached_artifact("auto", logs.append)
    assert len(calls) == 2


@pytest.mark.slow
def test_demo_cold(tmp_path):
    """The first `ellm demo` of an install: compiles the default model (sensitivity analysis included), then answers."""
    env = dict(os.environ, ELLM_CACHE=str(tmp_path))
    p = ellm("demo", "-n", "8", env=env, timeout=3600)
    assert p.returncode == 0, p.stderr
    assert "prefill:" in p.stdout and "tokens/s" in p.stdout
    again = ellm("demo", "-n", "4", env=env)
    assert "using cached artifact" in again.stderr


def test_run_sampling_flags_and_a_stop_string(artifact):
    counting = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"
    args = ["-n", "32", "--json", "--threads", "2", "--ctx-size", "256"]
    p = ellm("run", artifact, "-p", counting, "--stop", " 15", "--stop", "never", *args)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["stop_reason"] == "stop" and out["text"].strip() == "11, 12, 13, 14,"
    flags = ["--temp", "0.9", "--top-k", "20", "--top-p", "0.9", "--min-p", "0.05", "--repeat-penalty", "1.2",
             "--presence-penalty", "0.3", "--frequency-penalty", "0.2", "--seed", "11"]
    a, b = (json.loads(ellm("run", artifact, "-p", "Once upon a time", *flags, *args).stdout)["text"] for _ in range(2))
    assert a == b
    for bad in (["--temp", "nan"], ["--top-p", "0"], ["--repeat-penalty", "-1"], ["--stop", ""]):
        r = ellm("run", artifact, "-p", "x", *bad, *args)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (bad, r.stderr)


def test_serve_refuses_bad_options_in_one_line(artifact):
    for bad in (["--port", "70000"], ["--slots", "100000"], ["--prompt-cache", "x.kv"]):
        r = ellm("serve", artifact, "--ctx-size", "8192", *bad, timeout=120)
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (bad, r.stderr)
        assert r.stderr.startswith("error: ")
