"""The calling thread is kept off the cores TVM pins its workers to (runtime/threads.py)."""

from __future__ import annotations

import os

import pytest

from ellm.runtime.threads import _parse_cpu_list, free_cpus, worker_cpus


def test_parse_cpu_list():
    assert _parse_cpu_list("0-3,6\n") == {0, 1, 2, 3, 6}
    assert _parse_cpu_list("5") == {5}
    assert _parse_cpu_list("0,2-2,4-5") == {0, 2, 4, 5}


def _task(root, tid: int, cpus: str) -> None:
    d = root / str(tid)
    d.mkdir()
    (d / "status").write_text(f"Name:\tpython\nCpus_allowed:\tff\nCpus_allowed_list:\t{cpus}\nvoluntary_ctxt_switches:\t1\n")


def test_worker_cpus_reads_single_cpu_threads_but_not_the_caller(tmp_path):
    _task(tmp_path, 100, "0-7")  # the caller, free to run anywhere
    _task(tmp_path, 101, "1")  # TVM workers, one core each
    _task(tmp_path, 102, "2")
    _task(tmp_path, 103, "0-3")  # some other thread, unpinned
    (tmp_path / "104").mkdir()  # a thread that ended while we looked
    assert worker_cpus(tmp_path, caller=100) == {1, 2}
    assert worker_cpus(tmp_path, caller=101) == {2}
    assert worker_cpus(tmp_path, caller=100, callers={102}) == {1}  # a caller pinned earlier is no worker
    assert worker_cpus(tmp_path / "missing", caller=100) == set()


def test_free_cpus():
    assert free_cpus({0, 1, 2, 3}, {1, 2, 3}) == {0}
    assert free_cpus({0, 1}, {0, 1}) == {0, 1}  # nothing left: leave the caller where it may run
    assert free_cpus({4, 5}, {1}) == {4, 5}


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and 2 CPUs")
def test_set_threads_pins_a_new_caller_off_the_workers():
    """In a fresh thread (whose affinity is every CPU), set_threads leaves it none of the workers' cores, even
    where another thread (the main one, as by an engine) configured a pool and was pinned before. In a fresh
    process: pools that earlier tests' threads left behind hold cores of their own."""
    import json
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", NEW_CALLER], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    result = {k: set(v) for k, v in json.loads(r.stdout).items()}
    assert result["workers"], "TVM pins its workers to single cores"
    assert result["workers"] <= result["before"] and len(result["before"]) >= 2
    assert result["caller"] == result["before"] - result["workers"]


NEW_CALLER = """
import json, os, threading
from ellm.runtime.threads import set_threads, worker_cpus
set_threads(2)  # this thread launches kernels too: it is pinned first
result = {}

def body():
    os.sched_setaffinity(0, range(os.cpu_count()))  # the kernel keeps the CPUs this process may use
    before = os.sched_getaffinity(0)
    set_threads(2)
    result["caller"] = sorted(os.sched_getaffinity(0))
    result["workers"] = sorted(worker_cpus())
    result["before"] = sorted(before)

t = threading.Thread(target=body)
t.start()
t.join()
print(json.dumps(result))
"""
