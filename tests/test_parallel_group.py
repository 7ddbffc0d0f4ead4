"""A 2-rank tensor-parallel group run as TVM Disco workers (ellm/parallel/): its logits against the single-process
run of the same model, the CLI, and what the driver does when a worker dies or stops answering."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from synthetic import write_model

from ellm.compiler.build import CompileOptions, compile_model
from ellm.parallel.build import compile_group, read_group
from ellm.parallel.engine import ParallelEngine, rank_cpus
from ellm.runtime.engine import Engine

# float activations: the ranks' partial sums differ from the whole model's only in the order of float additions
OPTIONS = CompileOptions(target="x86-64-v3", precision="source", activations="f32")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("tpgroup")
    model = write_model(d / "tiny.gguf", n_layers=2)
    compile_model(model, d / "single", OPTIONS)
    compile_group(model, d / "group", 2, OPTIONS)
    return model, d / "single", d / "group"


@pytest.fixture(scope="module")
def group(built):
    eng = ParallelEngine(built[2], timeout_s=10)
    yield eng
    eng.close()


def test_the_group_gives_the_single_process_logits(built, group):
    single = Engine.load(built[1], threads=1)
    prompt = [5, 17, 33, 100, 7, 250, 12, 3]
    ref: list[np.ndarray] = []
    toks = single.generate(prompt, 64, stop_at_eog=False, on_logits=lambda t, lg: ref.append(np.array(lg)))
    assert len(toks) == 64
    got = [group.prefill(prompt)] + [np.array(group.decode(t)) for t in toks[:-1]]
    scale = max(float(np.abs(r).max()) for r in ref)
    for r, g in zip(ref, got):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-5 * scale)
    # greedy generation through the group picks the same tokens
    group.truncate(0)
    assert group.generate(prompt, 64, stop_at_eog=False) == toks
    per = group.decode_traffic.per(group.stats.decode_steps)
    # 1 + 2 per layer all-reduces of [1, 256] float32 and the logits' all-gather of 160 float32 a rank
    assert per["collectives"] == 1 + 2 * 2 + 1
    assert per["bytes_in"] == (1 + 2 * 2) * 256 * 4 + 160 * 4


def test_the_tcp_transport_gives_the_same_logits(built, group):
    tcp = ParallelEngine(built[2], timeout_s=10, transport="tcp")
    try:
        prompt = [9, 8, 7, 6]
        group.truncate(0)
        np.testing.assert_array_equal(tcp.prefill(prompt), group.prefill(prompt))
        for t in (1, 2, 3, 4):
            np.testing.assert_array_equal(tcp.decode(t), group.decode(t))
    finally:
        tcp.close()


def test_disco_session_collectives_use_the_cpu_collective(group):
    import tvm

    sess = group._sess
    src, dst = sess.empty((2, 3), "float32", tvm.cpu()), sess.empty((2, 3), "float32", tvm.cpu())
    gathered = sess.empty((4, 3), "float32", tvm.cpu())
    xs = [np.arange(6, dtype=np.float32).reshape(2, 3) * (r + 1) for r in range(2)]
    for r, x in enumerate(xs):
        src.debug_copy_from(r, x)
    sess.allreduce(src, dst)
    sess.allgather(src, gathered)
    sess._sync_all()
    for r in range(2):
        np.testing.assert_array_equal(dst.debug_get_from_remote(r).numpy(), xs[0] + xs[1])
        np.testing.assert_array_equal(gathered.debug_get_from_remote(r).numpy(), np.concatenate(xs))


def test_each_rank_holds_its_slice(built):
    g = read_group(built[2])
    sizes = [sum(p.stat().st_size for p in g.rank_dir(r).glob("weights.bin")) for r in range(2)]
    whole = (built[1] / "weights.bin").stat().st_size
    assert all(0.4 * whole < s < 0.65 * whole for s in sizes)
    assert g.ranks[0].kv_heads == (0, 1) and g.ranks[1].kv_heads == (1, 2)


def test_ranks_split_the_cpus():
    assert rank_cpus(2, [0, 1, 2, 3, 4]) == [(0, 1, 2), (3, 4)]
    with pytest.raises(Exception, match="need at least 3 CPUs"):
        rank_cpus(3, [0, 1])


def test_cli_compiles_and_runs_a_group(built, tmp_path):
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-m", "ellm", "run", str(built[2]), "-p", "the", "-n", "8", "--json"],
                         capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["ranks"] == 2 and len(r["tokens"]) >= 1 and r["collectives_per_token"]["collectives"] == 6
    bad = subprocess.run([sys.executable, "-m", "ellm", "compile", str(built[0]), "-o", str(tmp_path / "g"),
                          "--tp", "3", "--precision", "source"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "error: tensor parallelism gives each rank whole KV heads: this model has 2, too few for 3 ranks"]
    assert not (tmp_path / "g").exists()


# A driver script: open the group, decode, then signal rank 1's process and decode on.
_DRIVER = """
import os, signal, sys, time
from ellm.parallel.engine import ParallelEngine, ParallelError
eng = ParallelEngine(sys.argv[1], timeout_s=float(sys.argv[3]), transport=sys.argv[5])
eng.prefill([5, 6, 7])
for i in range(3):
    eng.decode(i)
os.kill(eng._pool.pids()[0], getattr(signal, sys.argv[2]))
if sys.argv[4] == "idle":
    time.sleep(1)
t = time.perf_counter()
try:
    for i in range(50):
        eng.decode(i)
    print("no error")
except ParallelError as e:
    print(f"{time.perf_counter() - t:.2f} {e}")
try:
    eng.decode(1)
except ParallelError as e:
    print(e)
eng.close()
"""


@pytest.mark.parametrize("sig, when, transport, expect, within", [
    ("SIGKILL", "step", "shm", "rank 1 \\(pid \\d+\\) died", 5.0),
    ("SIGKILL", "idle", "shm", "rank 1 \\(pid \\d+\\) died", 5.0),
    ("SIGSTOP", "step", "shm", "rank 1 did not answer within 2 s", 8.0),
    ("SIGKILL", "step", "tcp", "rank 1 closed its connection", 5.0),
])
def test_a_dead_or_silent_worker_is_an_error_never_a_hang(built, tmp_path, sig, when, transport, expect, within):
    import re

    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    t = time.perf_counter()
    out = subprocess.run([sys.executable, str(script), str(built[2]), sig, "2", when, transport], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr  # no abort in Disco's destructors
    first, second = out.stdout.strip().splitlines()
    secs, msg = first.split(" ", 1)
    assert re.search(expect, msg) and float(secs) < within, first
    assert "failed earlier" in second and "load it again" in second
    assert time.perf_counter() - t < 60
