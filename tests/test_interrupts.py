"""Ctrl-C, for real: a subprocess gets SIGINT mid-prefill, mid-decode and mid-compile. The engine is then usable
(its cache holds exactly what was fully written, and continuing gives what an uninterrupted run gives); an
interrupted compile leaves nothing, and one killed outright leaves only its temporary directory, which the next
compile removes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from synthetic import write_model

CHILD = Path(__file__).parent / "interrupt_child.py"


def _ctrl_c_default() -> None:
    """In the child before exec: SIGINT back to its default, so Python turns it into KeyboardInterrupt. A suite
    started in the background by a shell without job control inherits SIGINT ignored, as its children would."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_after(args: list[str], marker: str, count: int, timeout: float = 600) -> tuple[int, list[str], str]:
    """Start `args`, send SIGINT once `marker` has been printed `count` times; (exit status, stdout lines, stderr)."""
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_default)
    seen, lines = 0, []
    deadline = time.monotonic() + timeout
    for line in p.stdout:
        lines.append(line.strip())
        seen += line.strip() == marker
        if seen == count:
            p.send_signal(signal.SIGINT)
            break
        assert time.monotonic() < deadline, "the child never reached the point to interrupt"
    rest, err = p.communicate(timeout=timeout)
    return p.returncode, lines + rest.splitlines(), err


@pytest.mark.parametrize("mode,marker,count", [("prefill", "chunk", 1), ("decode", "token", 20)])
def test_sigint_mid_generation_leaves_the_engine_usable(artifact, mode, marker, count):
    code, lines, err = _interrupt_after([sys.executable, str(CHILD), str(artifact), mode], marker, count)
    assert code == 0, err
    r = json.loads(lines[-1])
    assert r["interrupted"], r  # the signal arrived while generate ran
    assert r["cache_is_a_prefix"], r  # what the cache holds was fully written, for exactly those tokens
    if mode == "prefill":
        assert 0 < r["n_cached"] < r["prompt"], r  # mid-prefill: some chunks written, not all
        assert r["reused"] == r["n_cached"], r  # and reused, not recomputed
    else:
        assert r["prompt"] + r["emitted"] - 1 <= r["n_cached"] <= r["prompt"] + r["emitted"], r
        assert r["same_tokens_again"] and r["reused"] >= r["n_cached"] - 1, r
    assert r["same_continuation"] and r["max_logit_diff"] == 0.0, r


@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory) -> Path:
    return write_model(tmp_path_factory.mktemp("m") / "small.gguf", n_layers=1, d=64, ff=128, heads=2, kv_heads=1)


def _compile(gguf: Path, out: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ellm", "compile", str(gguf), "-o", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=_ctrl_c_default)


def _partials(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.*"))


def _signal_once_writing(p: subprocess.Popen, out: Path, sig: int) -> bool:
    """Send `sig` as soon as the compile's temporary directory exists; whether it did before the compile ended."""
    while p.poll() is None:
        if _partials(out):
            p.send_signal(sig)
            return True
        time.sleep(0.005)
    return False


def test_an_interrupted_compile_leaves_no_half_artifact(tmp_path, small_gguf):
    out = tmp_path / "art"
    p = _compile(small_gguf, out)  # Ctrl-C: cleaned up on the way out
    assert _signal_once_writing(p, out, signal.SIGINT), "the compile ended before its temporary directory was seen"
    _, err = p.communicate(timeout=600)
    assert p.returncode == 130 and err.strip().splitlines()[-1] == "interrupted", err
    assert "Traceback" not in err and not out.exists() and not _partials(out)

    p = _compile(small_gguf, out)  # killed outright: no chance to clean up
    assert _signal_once_writing(p, out, signal.SIGKILL), "the compile ended before its temporary directory was seen"
    p.communicate(timeout=600)
    assert p.returncode == -signal.SIGKILL and not out.exists() and len(_partials(out)) == 1

    q = _compile(small_gguf, out)
    _, err = q.communicate(timeout=600)
    assert q.returncode == 0, err
    assert (out / "manifest.json").is_file() and not _partials(out)  # the next compile removed the leftover


_HALF_BUILT = """
import argparse, types, ellm.cli as cli
class Half:  # like TVM's TempDirectory when Ctrl-C lands inside its __init__
    def __init__(self):
        raise KeyboardInterrupt
    def __del__(self):
        self.temp_dir
def command(args):
    Half()
cli.build_parser = lambda: types.SimpleNamespace(parse_args=lambda argv: argparse.Namespace(func=command))
raise SystemExit(cli.main([]))
"""


def test_an_interrupt_inside_a_constructor_still_ends_in_one_line():
    # The clean-clone CI caught this: SIGINT inside TVM's TempDirectory() printed "Exception ignored
    # in ... AttributeError" after "interrupted" when the half-built object was freed.
    env = {k: v for k, v in os.environ.items() if k != "ELLM_DEBUG"}
    p = subprocess.run([sys.executable, "-c", _HALF_BUILT], capture_output=True, text=True, timeout=120, env=env)
    assert (p.returncode, p.stderr) == (130, "interrupted\n")


def test_a_live_writers_temporary_directory_is_left_alone(tmp_path):
    from ellm.fsutil import atomic_directory, clean_stale

    final = tmp_path / "art"
    with atomic_directory(final) as tmp:
        (tmp / "f").write_text("x")
        assert clean_stale(final) == [] and tmp.exists()  # ours: this process is alive
        dead = tmp_path / f".art.{2**22 + 12345}.abcdefgh.partial"  # a PID past pid_max: no such process
        dead.mkdir()
        assert clean_stale(final) == [dead] and not dead.exists()
    assert (final / "f").read_text() == "x" and os.listdir(tmp_path) == ["art"]
