"""Bad inputs get one clear line on stderr, exit status 2, no traceback, and nothing written half-way."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from gguf import GGMLQuantizationType as G
from synthetic import write_model



def ellm(*args, cwd=None, env=None) -> subprocess.CompletedProcess:
    """`env`: variables added to this process's environment."""
    full = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "ellm", *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=600, env=full)


def assert_user_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ")
    assert "Traceback" not in proc.stderr
    for f in fragments:
        assert f in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("m") / "tiny.gguf")


@pytest.fixture(scope="module")
def tiny_artifact(tmp_path_factory, tiny) -> Path:
    out = tmp_path_factory.mktemp("a") / "tiny"
    proc = ellm("compile", tiny, "-o", out)
    assert proc.returncode == 0, proc.stderr
    return out


def test_truncated_gguf(tmp_path, tiny):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(tiny.read_bytes()[: tiny.stat().st_size // 2])
    out = tmp_path / "out"
    assert_user_error(ellm("compile", bad, "-o", out), "truncated")
    assert not out.exists() and not list(tmp_path.glob(".out*"))


def test_truncated_header(tmp_path, tiny):
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(tiny.read_bytes()[:100])
    assert_user_error(ellm("compile", bad, "-o", tmp_path / "out"), "truncated or corrupt")


def test_wrong_magic(tmp_path, tiny):
    bad = tmp_path / "magic.gguf"
    bad.write_bytes(b"GGML" + tiny.read_bytes()[4:])
    assert_user_error(ellm("compile", bad, "-o", tmp_path / "out"), "not a GGUF file")


def test_a_bad_gguf_is_refused_before_tvm_is_imported(tmp_path, tiny):
    # `ellm inspect` on a corrupt file: the answer comes before the 1.5 s of importing TVM (0.6 s against 2.3)
    bad = tmp_path / "cut.gguf"
    bad.write_bytes(tiny.read_bytes()[:100])
    code = ("import sys; from ellm.cli import main; rc = main(['inspect', sys.argv[1]]); "
            "sys.exit(rc if 'tvm' not in sys.modules else 99)")
    p = subprocess.run([sys.executable, "-c", code, str(bad)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "truncated or corrupt" in p.stderr, (p.returncode, p.stderr)


def test_missing_model_file(tmp_path):
    assert_user_error(ellm("compile", tmp_path / "nope.gguf", "-o", tmp_path / "out"), "not found")


def test_unsupported_tensor_type(tmp_path):
    bad = write_model(tmp_path / "q5k.gguf", types={"up": G.Q5_K})
    out = tmp_path / "out"
    assert_user_error(ellm("compile", bad, "-o", out), "unsupported tensor type Q5_K", "blk.0.ffn_up.weight")
    assert not out.exists()


def test_unsupported_architecture(tmp_path):
    bad = write_model(tmp_path / "falcon.gguf", arch="falcon")
    assert_user_error(ellm("compile", bad, "-o", tmp_path / "out"), "unsupported architecture 'falcon'")


def test_existing_output_needs_force(tmp_path, tiny):
    out = tmp_path / "exists"
    out.mkdir()
    assert_user_error(ellm("compile", tiny, "-o", out), "already exists")


def test_tampered_artifact_file(tmp_path, tiny_artifact):
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    weights = art / "weights.bin"
    data = bytearray(weights.read_bytes())
    p = json.loads((art / "manifest.json").read_text())["params"][1]
    data[p["offset"] + p["nbytes"] // 2] ^= 0x40  # a byte the kernels read
    weights.write_bytes(bytes(data))
    assert_user_error(ellm("run", art, "-p", "hi", "-n", "1"), "weights.bin", "checksum", p["name"])


@pytest.mark.parametrize("name", ["tokenizer.json", "kernels"])
def test_every_other_file_is_checked(tmp_path, tiny_artifact, name):
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    (f,) = art.glob("kernels-*.so") if name == "kernels" else [art / name]
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))
    assert_user_error(ellm("run", art, "-p", "hi", "-n", "1"), f.name, "checksum")


def test_an_edited_manifest_fails_its_digest(tmp_path, tiny_artifact):
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    m = json.loads((art / "manifest.json").read_text())
    m["max_chunk"] = 8
    (art / "manifest.json").write_text(json.dumps(m))
    assert_user_error(ellm("run", art, "-p", "hi", "-n", "1"), "manifest.json does not match its digest")
    (art / "manifest.digest").unlink()
    assert_user_error(ellm("run", art, "-p", "hi", "-n", "1"), "manifest.digest is missing")


def test_artifact_missing_file(tmp_path, tiny_artifact):
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    (kernels,) = art.glob("kernels-*.so")
    kernels.unlink()
    assert_user_error(ellm("run", art, "-p", "hi"), kernels.name, "missing")


def test_not_an_artifact(tmp_path):
    assert_user_error(ellm("run", tmp_path, "-p", "hi"), "not an eLLM artifact")


def test_artifact_for_missing_cpu_feature(tmp_path, tiny):
    """Compiled for Sapphire Rapids (AMX), refused with the missing features named on a CPU without AMX (this
    one with AMX hidden, where it has it), before any kernel runs."""
    out = tmp_path / "spr"
    proc = ellm("compile", tiny, "-o", out, "--target", "sapphirerapids")
    assert proc.returncode == 0, proc.stderr
    manifest = json.loads((out / "manifest.json").read_text())
    assert "amx-int8" in manifest["targets"][0]["required_cpu_features"]
    assert_user_error(ellm("run", out, "-p", "hi", env={"ELLM_CPU_MASK": "amx*"}), "sapphirerapids", "amx")


def test_prompt_longer_than_context(tiny_artifact):
    assert_user_error(ellm("run", tiny_artifact, "-p", "the " * 200, "--ctx-size", "32"), "context", "32")


def test_unknown_target(tmp_path, tiny):
    assert_user_error(ellm("compile", tiny, "-o", tmp_path / "x", "--target", "pentium4"), "unknown target")


def test_interrupted_compile_leaves_nothing(tmp_path, tiny, monkeypatch):
    """An exception while writing the artifact removes the partial directory."""
    from ellm.compiler import build

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(build, "write_manifest", boom)
    out = tmp_path / "art"
    with pytest.raises(KeyboardInterrupt):
        build.compile_model(tiny, out, build.CompileOptions())
    assert list(tmp_path.iterdir()) == []


def test_a_prompt_file_that_is_not_utf8(tmp_path, tiny_artifact):
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9 au lait".encode("latin-1"))
    assert_user_error(ellm("run", tiny_artifact, "-f", bad, "-n", "1"), "is not UTF-8 text", "0xe9 at offset 3")


@pytest.mark.parametrize("margin", ["nan", "-1", "inf"])
def test_a_margin_that_is_not_a_finite_nonnegative_number(tiny_artifact, margin):
    assert_user_error(ellm("run", tiny_artifact, "-p", "hi", "-n", "1", f"--margin={margin}"), "margin must be a finite number")


def test_the_api_refuses_a_zero_context_instead_of_meaning_the_trained_one(tiny_artifact):
    import ellm as api
    from ellm.errors import EllmError

    with pytest.raises(EllmError, match="ctx_size must be at least 1, got 0"):
        api.load(tiny_artifact, ctx_size=0)
    with pytest.raises(EllmError, match="threads must be at least 1, got 0"):
        api.load(tiny_artifact, threads=0)


def test_a_context_that_cannot_be_allocated_is_refused_up_front(tiny_artifact):
    p = ellm("run", tiny_artifact, "-p", "hi", "-n", "1", "--ctx-size", str(10**10))
    assert_user_error(p, "a context of 10000000000 tokens needs", "GiB is available", "--ctx-size")


def test_a_context_past_the_trained_one_without_rope_scaling_warns_once(tiny_artifact):
    from ellm.runtime.limits import check_context
    from ellm.runtime.artifact import Artifact

    art = Artifact.open(tiny_artifact)
    logs: list[str] = []
    check_context(art.config, art.kv_plan, art.config.ctx_train, 0, None, logs.append)
    assert logs == []
    check_context(art.config, art.kv_plan, 4 * art.config.ctx_train, 0, None, logs.append)
    assert len(logs) == 1 and "--rope-scaling" in logs[0] and f"the {art.config.ctx_train} the model was trained" in logs[0]
    scaled = art.config.with_rope_scaling("yarn", 4.0)
    check_context(scaled, art.kv_plan, 4 * art.config.ctx_train, 0, None, logs.append)
    assert len(logs) == 1
    with pytest.raises(Exception, match="needs .* GiB .* but 0.00 GiB is available"):
        check_context(art.config, art.kv_plan, 1024, 0, 1000, logs.append)


def _tampered_manifest(tmp_path, tiny_artifact, edit) -> Path:
    art = tmp_path / "art"
    shutil.copytree(tiny_artifact, art)
    m = json.loads((art / "manifest.json").read_text())
    edit(m, art)
    _rewrite_manifest(art, json.dumps(m).encode())
    return art


def _rewrite_manifest(art, raw: bytes) -> None:
    """Past the digest: as someone who rewrites the envelope too (no fleet key), to reach the checks beneath."""
    from ellm.runtime.envelope import envelope

    (art / "manifest.json").write_bytes(raw)
    (art / "manifest.digest").write_text(envelope(raw))


def _first_kernels(m):
    return m["targets"][0]["kernels_file"]


MANIFEST_TAMPERING = [
    # found by the fuzzer (tests/test_fuzz_artifact.py): each was a TypeError, KeyError, ValueError or
    # AttributeError before it was checked
    ("a tokenizer part without its model", lambda m, art: m["tokenizer"].pop("model"), "manifest tokenizer is damaged"),
    ("an entry without a name", lambda m, art: m["entries"][0].pop("name"), "manifest entries[0].name is missing"),
    ("an entry that is no function name", lambda m, art: m["entries"][0].update(name=""), "is not a function name"),
    ("an entry the kernels lack", lambda m, art: m["entries"][0].update(name="nosuch"), "has no function nosuch"),
    ("an empty weights file", lambda m, art: (art / "weights.bin").write_bytes(b""), "inside the 0-byte weights file"),
    ("a null entry", lambda m, art: m["entries"].append(None), "manifest entries[4] should be an object, is NoneType"),
    ("a ../ file name", lambda m, art: m["files"].update({"../escape.bin": "0" * 64}), "not a plain file name"),
    ("a kernels file outside", lambda m, art: m["targets"][0].update(kernels_file="/etc/passwd"), "not a plain file name"),
    ("a symlinked file", lambda m, art: ((art / "weights.bin").rename(art / "w.real"),
                                         (art / "weights.bin").symlink_to(art / "w.real")), "is a symbolic link"),
    ("a missing key", lambda m, art: m.pop("kv_cache"), "manifest kv_cache is missing"),
    ("a mistyped key", lambda m, art: m.update(max_chunk="256"), "manifest max_chunk should be int, is str"),
    ("a target without params", lambda m, art: m["targets"][0].pop("params"), "manifest targets[0].params is missing"),
    ("a param index past the table", lambda m, art: m["targets"][0]["params"].append(10**6), "indexes past"),
    ("an offset beyond the file", lambda m, art: m["params"][0].update(offset=1 << 40), "inside the"),
    ("an unaligned offset", lambda m, art: m["params"][0].update(offset=m["params"][0]["offset"] + 64), "page-aligned"),
    ("a size that is not the shape's", lambda m, art: m["params"][0].update(nbytes=m["params"][0]["nbytes"] + 1), "bytes at offset"),
    ("a damaged config", lambda m, art: m["config"].pop("n_heads"), "manifest config is damaged"),
    ("a list for a manifest", None, "not an eLLM artifact"),
]


@pytest.mark.parametrize("what,edit,message", MANIFEST_TAMPERING, ids=[w for w, _, _ in MANIFEST_TAMPERING])
def test_a_tampered_manifest_is_one_line_before_any_kernel_runs(tmp_path, tiny_artifact, what, edit, message):
    if edit is None:
        art = tmp_path / "art"
        shutil.copytree(tiny_artifact, art)
        _rewrite_manifest(art, b"[1, 2]")
    else:
        art = _tampered_manifest(tmp_path, tiny_artifact, edit)
    assert_user_error(ellm("run", art, "-p", "hi", "-n", "1"), message)


@pytest.mark.parametrize("ctx", ["a,b", "512,-1", "0"])
def test_bench_contexts_are_checked_before_anything_is_compiled(tmp_path, ctx):
    # ELLM_CACHE empty: a check made after the default artifact's compile would take minutes, not this
    p = ellm("bench", "--ctx", ctx, env={"ELLM_CACHE": str(tmp_path / "cache")})
    assert_user_error(p, "--ctx takes comma-separated positive integers", repr(ctx))
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").rglob("manifest.json"))


def test_weights_changed_after_the_checks_are_refused_when_mapped(tmp_path, tiny_artifact):
    """What is verified is what is mapped: a parameter byte changed between opening (file checks) and mapping
    is caught on the mapped bytes themselves."""
    from ellm.errors import ArtifactError
    from ellm.runtime.artifact import Artifact

    art_dir = tmp_path / "art"
    shutil.copytree(tiny_artifact, art_dir)
    art = Artifact.open(art_dir)
    p = art.params[0]
    with open(art_dir / "weights.bin", "r+b") as f:
        f.seek(p.offset)
        byte = f.read(1)[0]
        f.seek(p.offset)
        f.write(bytes([byte ^ 0x40]))
    with pytest.raises(ArtifactError, match=f"parameter {p.name} in weights.bin does not match its checksum"):
        art.map_params()


def test_one_new_token_reports_no_decode_rate(tiny_artifact):
    p = ellm("run", tiny_artifact, "-p", "hi", "-n", "1")
    assert p.returncode == 0 and "no decode steps" in p.stderr and "nan" not in p.stderr, p.stderr
