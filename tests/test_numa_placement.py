"""NUMA placement: the task -> CPU maps of each --numa mode on fake topologies, and on this machine the memory
policy of every weight and KV page (get_mempolicy, move_pages), pinned threads, mlock, and the partitioned
layout on two pseudo-nodes giving exactly the unplaced logits."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fake_sysfs import make_sysfs

from conftest import THREADS
from ellm.errors import EllmError
from ellm.numa import memory
from ellm.numa.placement import NumaOptions
from ellm.numa.threadmap import thread_map
from ellm.numa.topology import read_topology

LINUX = sys.platform.startswith("linux")


def _topo(tmp_path, cores, smt=1):
    return read_topology(make_sysfs(tmp_path / "sys", cores, smt=smt))


@pytest.mark.parametrize("cores,smt,threads,want", [
    ([4, 4], 1, 8, [4, 4]),
    ([4, 4], 2, 8, [4, 4]),  # one thread per physical core, siblings unused
    ([4, 4], 1, 3, [2, 1]),
    ([2, 6], 1, 8, [2, 6]),  # asymmetric: by cores
    ([2, 2, 2, 2], 1, 8, [2, 2, 2, 2]),
    ([1] * 8, 2, 8, [1] * 8),
])
def test_distribute_spreads_consecutive_tasks_over_nodes(tmp_path, cores, smt, threads, want):
    topo = _topo(tmp_path, cores, smt)
    allowed = {c for n in topo.nodes for c in n.cpus}
    m = thread_map("distribute", threads, topo, allowed)
    assert [m.nodes.count(n.id) for n in topo.nodes] == want
    assert list(m.nodes) == sorted(m.nodes)  # a node's tasks are consecutive
    assert len(set(m.cpus)) == threads and all(topo.node_of_cpu(c) == n for c, n in zip(m.cpus, m.nodes))
    physical = set(topo.physical_cores(allowed))
    assert set(m.cpus) <= physical  # never an SMT sibling while a core is free


def test_isolate_numactl_and_none(tmp_path):
    topo = _topo(tmp_path, [4, 4], smt=2)  # node 0: CPUs 0-3 + 8-11, node 1: 4-7 + 12-15
    every = set(range(16))
    iso = thread_map("isolate", 4, topo, every, start_cpu=5)
    assert iso.cpus == (4, 5, 6, 7) and set(iso.nodes) == {1}
    # numactl --physcpubind=2,3,4,12: the mask's CPUs, physical cores of each node first
    ctl = thread_map("numactl", 4, topo, {2, 3, 4, 12}, start_cpu=2)
    assert sorted(ctl.cpus) == [2, 3, 4, 12] and ctl.node_ids() == (0, 1)
    assert thread_map("none", 4, topo, every) is None
    with pytest.raises(EllmError, match="17 threads"):
        thread_map("distribute", 17, topo, every)
    with pytest.raises(EllmError, match="--numa must be one of"):
        NumaOptions(mode="interleave")


def test_pseudo_nodes_split_whole_cores_on_the_real_memory(tmp_path):
    topo = _topo(tmp_path, [4], smt=2)
    pseudo, mem = topo.pseudo(2)
    assert [n.cpus for n in pseudo.nodes] == [(0, 1, 4, 5), (2, 3, 6, 7)] and mem == {0: 0, 1: 0}
    with pytest.raises(EllmError, match="between 1 and the 4 physical cores"):
        topo.pseudo(5)


@pytest.mark.skipif(not LINUX, reason="memory policies are Linux's")
def test_bind_then_query_policy_and_pages():
    from ellm.runtime.hugepages import huge_bytes

    a = huge_bytes(8 << 20)
    try:
        memory.bind(*memory.page_span(a), [0])
    except memory.PlacementUnavailable as e:
        pytest.skip(f"mbind refused here: {e}")
    a[:] = 1  # first touch, under the policy
    assert memory.policy_at(a.ctypes.data + 12345) == memory.Policy("bind", (0,))
    nodes = memory.page_nodes(*memory.page_span(a))
    assert len(nodes) == 2048 and (nodes == 0).all()
    b = huge_bytes(1 << 20)
    assert (memory.page_nodes(*memory.page_span(b)) < 0).all()  # never touched: no page yet (-ENOENT)


def _placed_arrays(eng):
    return [a for _, a in eng.placement.regions]


@pytest.mark.skipif(not LINUX, reason="memory policies are Linux's")
def test_every_weight_and_kv_page_is_bound_to_node_0_and_threads_are_pinned(artifact):
    import ellm
    from ellm.runtime.threads import thread_affinities

    eng = ellm.load(artifact, threads=THREADS, ctx_size=4096, numa=NumaOptions(mode="distribute", mlock=True))
    p = eng.placement
    if any("binding unavailable" in w for w in p.warnings):
        pytest.skip(p.warnings[0])
    eng.prefill(list(range(100, 164)))
    weights, *kv = _placed_arrays(eng)
    assert weights.nbytes >= sum(r["nbytes"] for r in eng.artifact.param_records())
    for r in eng.artifact.param_records():  # every parameter: its pages present, on node 0, bound there
        lo, n = memory.inner_span(weights, r["offset"], r["offset"] + r["nbytes"])
        if n:
            assert memory.policy_at(lo) == memory.Policy("bind", (0,)), r["name"]
            assert (memory.page_nodes(lo, n) == 0).all(), r["name"]
    assert len(kv) == len(eng.kv_plan.state_tensors())
    for a in kv:
        lo, n = memory.inner_span(a)
        if n:
            assert memory.policy_at(lo).mode == "bind" and memory.policy_at(lo).nodes == (0,)
    assert p.bound_bytes > 0.95 * weights.nbytes
    # pinned: the caller on task 0's CPU, a worker on each other task's CPU
    cpus = p.threads.cpus
    assert set(cpus) <= set(os.sched_getaffinity(0)) | set(cpus)
    assert os.sched_getaffinity(0) == {cpus[0]}
    singles = [c for c in thread_affinities().values() if len(c) == 1]
    assert all((c,) in singles for c in cpus[1:])
    # --mlock: everything placed is locked (root, or a high enough RLIMIT_MEMLOCK) or one warning says why not
    if p.locked_bytes:
        assert p.locked_bytes >= weights.nbytes and _vmlck() >= p.locked_bytes // 1024
    else:
        assert len(p.warnings) == 1 and "--mlock" in p.warnings[0]


def _vmlck() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmLck:"):
            return int(line.split()[1])
    return 0


def _drop_ipc_lock() -> None:
    """Drop CAP_IPC_LOCK from the bounding set (prctl PR_CAPBSET_DROP), so the program exec'd next lacks it
    even as root (root's capabilities are recomputed from the bounding set at exec)."""
    import ctypes

    if os.getuid() != 0:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(24, 14, 0, 0, 0) != 0:  # PR_CAPBSET_DROP, CAP_IPC_LOCK
        raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP, CAP_IPC_LOCK)")


MLOCK_REFUSED = """
import numpy as np
from ellm.numa.placement import NumaOptions, Placement
from ellm.runtime.hugepages import huge_bytes
p = Placement(NumaOptions(mlock=True), "none", 1, None, None)
p.regions.append(("weights", huge_bytes(64 << 20)))
p.lock(print)
assert p.locked_bytes == 0 and len(p.warnings) == 1
"""


@pytest.mark.skipif(not LINUX, reason="RLIMIT_MEMLOCK is Linux's")
def test_mlock_past_the_limit_warns_once_and_goes_on():
    import resource

    def drop():
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))
        _drop_ipc_lock()  # root (CAP_IPC_LOCK) locks past any limit

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    r = subprocess.run([sys.executable, "-c", MLOCK_REFUSED], capture_output=True, text=True, preexec_fn=drop,
                       cwd="/", env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    (line,) = r.stdout.strip().splitlines()
    assert line.startswith("warning: --mlock: could not lock weights") and "RLIMIT_MEMLOCK 1 MiB" in line


def test_two_pseudo_nodes_give_exactly_the_unplaced_logits(artifact):
    """The 2 cores as 2 simulated nodes: weights split by the plan and copied in by each node's thread, KV
    heads bound per node, tasks pinned node by node: the same logits, bit for bit, as no placement."""
    import ellm

    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 cores")
    ids = list(range(200, 300))
    runs = {}
    for name, numa in (("none", NumaOptions(mode="none")), ("pseudo", NumaOptions(mode="distribute", pseudo_nodes=2))):
        eng = ellm.load(artifact, threads=2, ctx_size=1024, numa=numa)
        first = eng.prefill(ids)
        tok, rows = int(np.argmax(first)), [first.copy()]
        for _ in range(16):
            rows.append(eng.decode(tok).copy())
            tok = int(np.argmax(rows[-1]))
        runs[name] = (np.stack(rows), eng.placement)
        n_kv_heads = eng.config.n_kv_heads
        del eng
    np.testing.assert_array_equal(runs["pseudo"][0], runs["none"][0])
    placed = runs["pseudo"][1]
    assert placed.plan.nodes == (0, 1) and placed.threads.cpus == (0, 1) and placed.threads.nodes == (0, 1)
    assert placed.plan.kv_heads[0][0] == 0 and placed.plan.kv_heads[-1][1] == n_kv_heads
    assert placed.plan.imbalance() < 0.05 and placed.bound_bytes > 0 and not placed.warnings


def test_mmap_keeps_the_file_mapping_and_mlock_locks_it(artifact):
    import ellm
    from ellm.runtime.artifact import WEIGHTS

    eng = ellm.load(artifact, threads=THREADS, ctx_size=512, numa=NumaOptions(mmap=True, mlock=True))
    what, weights = eng.placement.regions[0]
    assert what == "weights" and eng.placement.weights == "mmap" and isinstance(weights, np.memmap)
    assert Path(weights.filename).resolve() == (artifact / WEIGHTS).resolve()
    if eng.placement.locked_bytes:
        assert eng.placement.locked_bytes >= weights.nbytes
    else:
        assert len(eng.placement.warnings) == 1 and "--mlock" in eng.placement.warnings[0]


@pytest.mark.skipif(not LINUX or len(os.sched_getaffinity(0)) < 2, reason="needs Linux and 2 CPUs")
def test_task_i_of_a_parallel_kernel_runs_on_cpus_i():
    """The task -> CPU map is fixed: TVM splits a parallel loop statically (task i of T takes iterations
    [i ceil(n/T), (i+1) ceil(n/T))) and set_threads pins task i to cpus[i]; each iteration records the CPU it
    ran on (sched_getcpu), in either order of the CPUs, on every call."""
    import tvm
    from tvm.script import tirx as T

    from ellm.numa.topology import allowed_cpus
    from ellm.runtime.threads import set_threads

    @T.prim_func
    def where(out: T.Buffer((12,), "int32")):
        for i in T.parallel(12):
            out[i] = T.call_extern("int32", "sched_getcpu")

    kernel = tvm.compile(tvm.IRModule({"main": where}), target="llvm")["main"]
    a, b = sorted(allowed_cpus())[:2]  # the process's CPUs (earlier tests pinned this thread to one)
    for cpus in ((a, b), (b, a)):
        set_threads(2, cpus)
        out = tvm.runtime.tensor(np.full(12, -1, "int32"))
        for _ in range(5):
            kernel(out)
            assert out.numpy().tolist() == [cpus[0]] * 6 + [cpus[1]] * 6
    set_threads(THREADS)
