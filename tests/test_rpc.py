"""Distributed measurement through TVM's RPC tracker, on loopback: a tracker and two servers under one key.
A 16-trial tune measures on both; with one server killed mid-run, the tune still finishes on the other and
only that server's in-flight trial is lost."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from kernels import PRESET
from synthetic import write_model

from ellm.autotune import TuneOptions, TuningDatabase, tune_model
from ellm.autotune.measure import Workload

pytest.importorskip("tornado")
KEY = "ellm-test"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _servers_up(port: int, n: int) -> bool:
    import tvm.rpc

    try:
        info = tvm.rpc.connect_tracker("127.0.0.1", port).summary()
    except (OSError, RuntimeError):
        return False
    return sum(1 for s in info.get("server_info", []) if s.get("key") == f"server:{KEY}") >= n


@pytest.fixture
def tracker():
    """(tracker port, [server processes]); everything killed afterwards."""
    port = _free_port()
    py = [sys.executable, "-m"]
    procs = [subprocess.Popen(py + ["tvm.exec.rpc_tracker", "--host", "127.0.0.1", "--port", str(port), "--port-end",
                                    str(port + 1)], start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)]
    deadline = time.time() + 60
    while not _servers_up(port, 0) and time.time() < deadline:
        time.sleep(0.5)
    servers = []
    for _ in range(2):
        sp = _free_port()
        servers.append(subprocess.Popen(py + ["tvm.exec.rpc_server", "--tracker", f"127.0.0.1:{port}", "--key", KEY, "--host",
                                              "127.0.0.1", "--port", str(sp), "--port-end", str(sp + 20)],
                                        start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    while not _servers_up(port, 2) and time.time() < deadline:
        time.sleep(0.5)
    assert _servers_up(port, 2), "the RPC tracker and servers did not come up"
    yield port, servers
    for p in procs + servers:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()


def _tune(tmp_path, port, trials=16):
    from ellm.autotune.rpc import RPCRunner

    model = write_model(tmp_path / "m.gguf", n_layers=1)
    wl = Workload(ctx=256, layers=1)
    runner = RPCRunner(f"127.0.0.1:{port}", KEY, wl, threads=1)
    assert runner.sessions == 2 and runner.cpu.startswith(KEY)
    db = tune_model(model, tmp_path / "db.jsonl", target=PRESET.name, threads=1, workload=wl, kernels=r"^matmul_q4_1_256x512_m1_",
                    options=TuneOptions("random", trials=trials, batch=8, patience=None, confirm=0), runner=runner)
    return db


def test_a_tune_measures_on_every_server(tmp_path, tracker):
    port, _ = tracker
    db = _tune(tmp_path, port)
    trials = db.trials()
    assert len(trials) == 16 and all(r.status == "ok" for r in trials)
    assert len({r.runner for r in trials}) == 2 and all(r.runner.startswith(f"rpc:{KEY}@127.0.0.1:") for r in trials)
    assert all(r.cpu.startswith(KEY) and r.stats["method"] == "rpc-flush" for r in trials)


def test_a_server_killed_mid_run_loses_only_its_trials(tmp_path, tracker):
    port, servers = tracker
    path = tmp_path / "db.jsonl"

    def kill_after_some_trials():
        deadline = time.time() + 300
        while time.time() < deadline:
            if path.exists() and len(path.read_text().splitlines()) >= 5:  # the first batch recorded (8 trials)
                os.killpg(servers[1].pid, signal.SIGKILL)
                return
            time.sleep(0.05)

    killer = threading.Thread(target=kill_after_some_trials)
    killer.start()
    db = _tune(tmp_path, port, trials=24)
    killer.join()
    trials = TuningDatabase.open(path).trials()
    assert len(trials) == len(db.trials()) == 24
    lost = [r for r in trials if r.status != "ok"]
    assert len(lost) <= 2 and all(r.status == "run_error" for r in lost)  # in flight on the dead server
    assert sum(r.status == "ok" for r in trials) >= 22
    late = [r for r in trials[12:] if r.status == "ok"]
    assert late and len({r.runner for r in late}) == 1  # after the kill, only the survivor measures
