"""The tuner's build workers: they never outlive the process that started them."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

# starts a builder, lets its worker finish one (failing) job, prints the workers' pids and waits to be killed
TUNER = """
import time
from ellm.autotune.builder import BuildJob, LocalBuilder
b = LocalBuilder(2)
(r,) = b.build([BuildJob("no_such_rule", None, "znver3", {})])
assert r.status == "build_error", r
print(" ".join(str(p) for p in b._pool._processes), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="workers follow their parent on Linux only")
def test_workers_die_with_the_tuner_that_started_them():
    """A tune killed mid-run (SIGKILL: no cleanup runs) must not leave workers compiling beside the next
    run's timings: an idle worker holds both ends of its job queue, so it would wait forever."""
    proc = subprocess.Popen([sys.executable, "-c", TUNER], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert pids and all(_alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 20
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
