"""The compile-time NUMA layout (`--numa-nodes N`, compiler/passes/plan_numa_layout.py): recorded in the
manifest, the same plan load would make from the artifact's parameter records, and used at load where that
many nodes are in use."""

from __future__ import annotations

import os

import numpy as np
import pytest
from synthetic import write_model

from ellm.compiler.build import CompileOptions, build_graph, compile_model
from ellm.compiler.gguf_file import GGUFFile
from ellm.config import ModelConfig
from ellm.errors import EllmError
from ellm.numa.placement import NumaOptions
from ellm.numa.plan import plan_layout, weights_of_params
from ellm.compiler.passes.plan_numa_layout import stated_topology
from ellm.runtime.artifact import Artifact
from ellm.targets import resolve_target


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    # 4 KV heads of 64 rows over 2 or 4 nodes; FFN and head of 16-row tiles that split unevenly
    return write_model(tmp_path_factory.mktemp("numa") / "tiny.gguf", n_layers=2, d=256, ff=672, heads=8, kv_heads=4,
                       vocab=330)


@pytest.mark.parametrize("nodes", [1, 2, 4])
def test_the_pass_records_a_balanced_plan_only_when_asked(tiny, nodes):
    gf = GGUFFile(tiny)
    cfg = ModelConfig.from_gguf(gf)
    preset = resolve_target("x86-64-v3")
    _, plain = build_graph(gf, cfg, CompileOptions(precision="source"), preset)
    assert plain.meta("numa") is None
    _, g = build_graph(gf, cfg, CompileOptions(precision="source", numa_nodes=nodes), preset)
    plan = g.meta("numa")
    assert plan["nodes"] == list(range(nodes)) and plan["imbalance"] < 0.05
    heads = [h1 - h0 for h0, h1 in plan["kv_heads"]]
    assert sum(heads) == 4 and max(heads) - min(heads) <= 1
    qkv = [n for n in plan["matrices"] if "attn_q+attn_k+attn_v" in n]
    assert len(qkv) == 2 and "token_embd.weight" in plan["matrices"]  # the tied head is a matmul, planned


def test_numa_nodes_is_checked():
    with pytest.raises(EllmError, match="--numa-nodes must be between 1 and 64"):
        CompileOptions(numa_nodes=65)


def test_compiled_plan_is_loads_plan_and_used_on_as_many_nodes(tiny, tmp_path):
    """The kernels run the plan's tasks (schedules/node_tasks.py) and give TVM's static split's logits bit for bit."""
    import ellm

    out, plain = tmp_path / "a", tmp_path / "plain"
    compile_model(tiny, out, CompileOptions(target="x86-64-v3", precision="source", numa_nodes=2, numa_threads=(1,)))
    art = Artifact.open(out)
    recorded = art.manifest["numa"]
    # what load would plan from the artifact's own parameter records, for 2 nodes
    again = plan_layout(weights_of_params(art.param_records(), art.manifest["config"]), art.config.n_kv_heads,
                        stated_topology((1, 1)))
    assert again.to_dict()["matrices"] == recorded["matrices"] and again.to_dict()["kv_heads"] == recorded["kv_heads"]
    marks = {(k["rule"], k["request"]["m"]): k.get("numa_tasks") for k in art.target["kernels"]}
    for rule in ("avx2_gemv", "attention_input", "attention_decode"):  # decode's weight and KV readers
        assert marks[(rule, 1)] == "planned"
    assert marks[("avx2_gemm", None)] == "planned"
    assert marks[("gemv", 1)] == "static"  # the 330-row head is not whole tiles: a float kernel, TVM's split
    assert marks[("embedding", 1)] is None
    if (os.cpu_count() or 1) < 2:
        pytest.skip("two pseudo-nodes need 2 cores")
    compile_model(tiny, plain, CompileOptions(target="x86-64-v3", precision="source"))
    ids = list(range(3, 60))
    logits = {}
    for name, path, numa in (("plain", plain, NumaOptions(mode="none")), ("none", out, NumaOptions(mode="none")),
                             ("two", out, NumaOptions(mode="distribute", pseudo_nodes=2)),
                             ("one", out, NumaOptions(mode="distribute"))):
        eng = ellm.load(path, threads=2, ctx_size=256, numa=numa)
        logits[name] = [eng.prefill(ids).copy()] + [eng.decode(7 + i).copy() for i in range(12)]
        logits[name].append(eng.verify([4, 9, 11, 2, 30]).copy())  # rows as one-token steps: split-K per row
        if name == "two":
            assert eng.placement.plan_origin == "artifact" and eng.placement.plan.kv_heads == ((0, 2), (2, 4))
            assert eng.placement.kernel_tasks == "partial"  # the float head keeps TVM's split
        if name == "one":  # this machine's one node: not the 2-node layout, planned here
            assert eng.placement.plan_origin == "load" and len(eng.placement.plan.nodes) == 1
            assert eng.placement.kernel_tasks == "static"
    for name in logits:
        for a, b in zip(logits[name], logits["plain"]):
            np.testing.assert_array_equal(a, b)


def test_kernels_compiled_for_other_threads_per_node_warn(tiny, tmp_path):
    from ellm.numa.placement import planned_kernels as kernel_tasks

    compiled = {"cpus": [[0, 1], [2, 3]]}
    kernels = [{"numa_tasks": "planned"}, {}]
    assert kernel_tasks(compiled, kernels, ((0, 1), (2, 3))) == ("planned", [])
    assert kernel_tasks(compiled, kernels + [{"numa_tasks": "static"}], ((5, 6), (7, 8))) == ("partial", [])
    tasks, warn = kernel_tasks(compiled, kernels, ((0,), (2,)))
    assert tasks == "static" and "[2, 2] threads per NUMA node" in warn[0] and "runs [1, 1]" in warn[0]
    assert kernel_tasks(compiled, [{}], ((0,), (2,))) == ("static", [])
    with pytest.raises(EllmError, match="--numa-threads takes --numa-nodes"):
        CompileOptions(numa_threads=(2,))
    with pytest.raises(EllmError, match="--numa-threads takes --numa-nodes"):
        CompileOptions(numa_nodes=2, numa_threads=(2, 2, 2))
