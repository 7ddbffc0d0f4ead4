"""Kernels that run a NUMA plan's task -> thread map (schedules/node_tasks.py): the ranges each task computes
are the plan's, the parallel loop has one task per thread (so TVM's static split gives task i to thread i), and
the results equal those of TVM's own split bit for bit."""

from __future__ import annotations

import os

import numpy as np
import pytest
from tvm import tirx
from tvm.sym import Analyzer

from ellm.compiler.graph import OpKind
from ellm.numa.plan import plan_layout
from ellm.numa.topology import read_topology
from ellm.quant import QuantType
from ellm.quant.tiled import TILED_COMPONENTS, pack_tiled
from ellm.schedules.node_tasks import ATTR, NodeTasks
from ellm.schedules.tir_walk import rewrite_loops
from fake_sysfs import make_sysfs
from gguf.quants import quantize
from conftest import THREADS
from kernels import ISA_PRESETS, build, build_request, matmul_request, run, runnable
from ellm.targets import IsaClass
from test_numa_plan import SHAPES, TOPOLOGIES, _weights

AVX2 = ISA_PRESETS[IsaClass.AVX2]


def _const(e) -> int:
    v = Analyzer().simplify(e)
    assert isinstance(v, tirx.IntImm), v
    return int(v.value)


@pytest.mark.parametrize("cores,smt", TOPOLOGIES)
def test_the_kernels_bounds_are_the_plans_tasks(tmp_path, cores, smt):
    """Each task's ranges, as the expressions a kernel computes evaluate, are plan.tasks' (every node shape)."""
    topo = read_topology(make_sysfs(tmp_path, cores, smt))
    shape = SHAPES["smollm2"]
    plan = plan_layout(_weights(shape), shape[3], topo)
    threads = [len(c) for c in plan.cpus]
    for m in plan.matrices[:4] + plan.matrices[-1:]:
        tasks = NodeTasks.make(threads, m.ranges)
        assert tasks.n_tasks == sum(cores)
        for i, (_, _, want) in enumerate(plan.tasks(m.name)):
            got = [(_const(lo), _const(hi)) for lo, hi in tasks.bounds(tirx.const(i, "int64"))]
            assert [r for r in got if r[1] > r[0]] == list(want) == [r for r in tasks.task_ranges(i) if r[1] > r[0]]


def test_scaled_units_and_runtime_scale():
    # two nodes of 2 and 1 threads; ranges in tiles of 4 per head
    tasks = NodeTasks.make([2, 1], [[(0, 8), (16, 20)], [(8, 16)]])
    heads = tasks.scaled(4)
    assert heads.ranges == (((0, 2), (4, 5)), ((2, 4), (0, 0)))
    assert [heads.task_ranges(i) for i in range(3)] == [[(0, 1), (4, 4)], [(1, 2), (4, 5)], [(2, 4), (0, 0)]]
    with pytest.raises(ValueError, match="whole units of 3"):
        tasks.scaled(3)
    # units standing for a run-time number of finer ones (split-K jobs: runs x rows per KV head)
    lo, hi = NodeTasks.make([2, 1], [[(0, 2)], [(2, 3)]]).bounds(tirx.const(1, "int64"), tirx.const(5, "int32"))[0]
    assert (_const(lo), _const(hi)) == (5, 10)  # node 0's 2 heads x 5 = 10 jobs, its second thread's half


def _parallel_extents(func) -> list[int]:
    out = []

    def visit(loop):
        if loop.kind == tirx.ForKind.PARALLEL:
            out.append(int(loop.extent) if isinstance(loop.extent, tirx.IntImm) else -1)
        return loop

    rewrite_loops(func.body, visit)
    return out


NODES = NodeTasks.make([2, 1], [[(0, 3)], [(3, 8)]])  # 128 rows: node 0 tiles 0-2 on 2 threads, node 1 the rest


@pytest.mark.parametrize("m", [1, None])
@pytest.mark.parametrize("tiles_per_task", [1, 2])
def test_int_matmul_runs_the_plans_tasks_with_the_same_results(m, tiles_per_task):
    req = matmul_request(QuantType.Q4_1, 128, 256, m=m, layout="tile16", act_bits=8)
    planned = matmul_request(QuantType.Q4_1, 128, 256, m=m, layout="tile16", act_bits=8)
    planned = planned.__class__(**{**planned.__dict__, "attrs": tuple(sorted(dict(planned.attrs, **{ATTR: NODES.to_attr()}).items()))})
    knobs = {"tiles_per_task": tiles_per_task} | ({} if m == 1 else {"tokens_per_tile": 1})
    _, plain_f = build_request(req, knobs, preset=AVX2)
    rule, node_f = build_request(planned, knobs, preset=AVX2)
    assert rule.follows_numa_tasks
    # one parallel task per thread (3) for the matmul phase, where TVM's split has 8 / tiles_per_task
    assert 3 in _parallel_extents(node_f) and 8 // tiles_per_task not in _parallel_extents(node_f)
    assert 8 // tiles_per_task in _parallel_extents(plain_f)
    if not runnable(AVX2):
        pytest.skip("this CPU cannot run AVX2 code")
    rng = np.random.default_rng(0)
    raw = quantize(rng.standard_normal((128, 256)).astype(np.float32) * 0.05, int(QuantType.Q4_1))
    comps = pack_tiled(raw, QuantType.Q4_1)
    rows = 1 if m == 1 else 5
    x = rng.standard_normal((rows, 256)).astype(np.float32)
    outs = []
    for f in (plain_f, node_f):
        args = [x] + [comps[c.name] for c in TILED_COMPONENTS[QuantType.Q4_1]]
        outs.append(run(build(f, AVX2), *args, np.zeros((rows, 128), np.float32), name="int_matmul")[-1].numpy())
    np.testing.assert_array_equal(outs[0], outs[1])


def test_rules_that_keep_the_static_split_say_so():
    from ellm.schedules import select_rule

    req = matmul_request(QuantType.Q4_1, 100, 256, m=1, kind=OpKind.LM_HEAD)  # rows, not tiles: a float kernel
    assert not select_rule(req, AVX2).follows_numa_tasks


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs")
def test_each_unit_runs_on_a_cpu_of_its_own_node():
    """At run time, through the loop the kernels use: every unit a node owns is computed on that node's CPU
    (each unit records sched_getcpu), for either order of the CPUs, on every call."""
    import tvm
    from tvm.script.ir_builder import IRBuilder
    from tvm.tirx.script.builder import ir as I

    from ellm.numa.topology import allowed_cpus
    from ellm.runtime.threads import set_threads

    nodes = NodeTasks.make([1, 1], [[(0, 5)], [(5, 12)]])  # node 0: units 0-4, node 1: units 5-11
    with IRBuilder() as ib:
        with I.prim_func():
            I.func_name("main")
            out = I.arg("out", I.buffer((12,), "int32"))

            def body(task, ranges):
                for lo, hi in ranges:
                    with I.serial(lo, hi) as u:
                        I.buffer_store(out, tirx.call_extern("int32", "sched_getcpu"), [u])

            nodes.loop(body, "int32")
    kernel = tvm.compile(tvm.IRModule({"main": ib.get()}), target="llvm")["main"]
    a, b = sorted(allowed_cpus())[:2]
    try:
        for cpus in ((a, b), (b, a)):
            set_threads(2, cpus)
            got = tvm.runtime.tensor(np.full(12, -1, "int32"))
            for _ in range(5):
                kernel(got)
                assert got.numpy().tolist() == [cpus[0]] * 5 + [cpus[1]] * 7
    finally:
        set_threads(THREADS)
