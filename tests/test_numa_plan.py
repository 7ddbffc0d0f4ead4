"""NUMA layout plans (ellm/numa/plan.py) over fake topologies: balance, node-local reads, KV heads, tasks."""

from __future__ import annotations

import pytest

from ellm.numa.plan import TILE_ROWS, WeightRows, plan_layout, split_heads
from ellm.numa.topology import read_topology
from fake_sysfs import make_sysfs

# (layers, d_model, n_heads, n_kv_heads, head_dim, d_ff, vocab): SmolLM2-135M, Llama-3.2-1B, Llama-3.1-8B
SHAPES = {"smollm2": (30, 576, 9, 3, 64, 1536, 49152), "1b": (16, 2048, 32, 8, 64, 8192, 128256),
          "8b": (32, 4096, 32, 8, 128, 14336, 128256)}
Q4_1 = 20 / 32  # bytes per weight


def _weights(shape) -> list[WeightRows]:
    layers, d, nh, nkv, hd, ff, vocab = shape
    out = []
    for i in range(layers):
        out += [
            WeightRows(f"blk.{i}.attn_q+attn_k+attn_v", (nh + 2 * nkv) * hd // TILE_ROWS, TILE_ROWS * d * Q4_1,
                       (nh, nkv, hd)),
            WeightRows(f"blk.{i}.attn_output", d // TILE_ROWS, TILE_ROWS * nh * hd * Q4_1),
            WeightRows(f"blk.{i}.ffn_gate+ffn_up", 2 * ff // TILE_ROWS, TILE_ROWS * d * Q4_1),
            WeightRows(f"blk.{i}.ffn_down", d // TILE_ROWS, TILE_ROWS * ff * Q4_1),
        ]
    return out + [WeightRows("output", vocab // TILE_ROWS, TILE_ROWS * d * Q4_1)]


TOPOLOGIES = [([2], 1), ([8, 8], 1), ([8, 8], 2), ([4, 4, 4, 4], 2), ([6] * 8, 1), ([12, 4], 2)]


@pytest.mark.parametrize("model", SHAPES)
@pytest.mark.parametrize("cores,smt", TOPOLOGIES)
def test_plans_balance_bytes_and_read_only_their_own_rows(tmp_path, model, cores, smt):
    topo = read_topology(make_sysfs(tmp_path, cores, smt))
    shape = SHAPES[model]
    weights = _weights(shape)
    plan = plan_layout(weights, shape[3], topo)
    assert plan.imbalance() < 0.05, plan.bytes_per_node()
    # every matrix's units are covered exactly once, in tile units
    for w, m in zip(weights, plan.matrices):
        covered = sorted(u for rs in m.ranges for a, b in rs for u in range(a, b))
        assert covered == list(range(w.units))
    # threads: one per physical core of each node, and each thread's tasks lie in its own node's ranges
    assert [len(c) for c in plan.cpus] == cores
    for w in weights[:8]:
        tasks = plan.tasks(w.name)
        assert len(tasks) == sum(cores)
        m = plan.matrix(w.name)
        for node, cpu, ranges in tasks:
            k = plan.nodes.index(node)
            assert topo.node_of_cpu(cpu) == node
            assert all(any(a <= lo and hi <= b for a, b in m.ranges[k]) for lo, hi in ranges)
        assert sorted(u for _, _, rs in tasks for lo, hi in rs for u in range(lo, hi)) == list(range(w.units))
        assert tasks == plan.tasks(w.name)  # deterministic


@pytest.mark.parametrize("model", SHAPES)
@pytest.mark.parametrize("n_nodes", [1, 2, 4, 8])
def test_kv_heads_keep_their_kv_rows_and_query_heads_even_out_the_kernel(tmp_path, model, n_nodes):
    topo = read_topology(make_sysfs(tmp_path, [2] * n_nodes))
    layers, d, nh, nkv, hd, ff, vocab = SHAPES[model]
    plan = plan_layout(_weights(SHAPES[model]), nkv, topo)
    assert [b - a for a, b in plan.kv_heads] == [b - a for a, b in split_heads(nkv, n_nodes)]
    assert sum(b - a for a, b in plan.kv_heads) == nkv
    qkv = plan.matrix("blk.0.attn_q+attn_k+attn_v")
    per = hd // TILE_ROWS
    q_units, heads, q_heads = [], [], []
    for k, (a, b) in enumerate(plan.kv_heads):
        ranges = list(qkv.ranges[k])
        kv = [(nh * per + a * per, nh * per + b * per), ((nh + nkv) * per + a * per, (nh + nkv) * per + b * per)]
        kv = [r for r in kv if r[1] > r[0]]
        assert ranges[len(ranges) - len(kv):] == kv  # the keys and values of its own KV heads
        q = [r for r in ranges[: len(ranges) - len(kv)]]
        assert all(hi <= nh * per for _, hi in q)
        q_units += [u for lo, hi in q for u in range(lo, hi)]
        q_heads.append(sum(hi - lo for lo, hi in q) // per)
        heads.append(sum(hi - lo for lo, hi in ranges) // per)
    assert sorted(q_units) == list(range(nh * per))  # every query head once
    # as even as whole heads allow: only nodes with no query heads (their K and V alone) may stand above
    assert all(q_heads[k] == 0 for k, h in enumerate(heads) if h > min(heads) + 1), (heads, q_heads)
    if nkv % n_nodes == 0:
        assert max(heads) - min(heads) <= 1


def test_every_other_matrix_is_split_evenly_per_kernel(tmp_path):
    plan = plan_layout(_weights(SHAPES["smollm2"]), 3, read_topology(make_sysfs(tmp_path, [1, 1])))
    for m in plan.matrices:
        if "attn_q" not in m.name:
            assert abs(m.units(0) - m.units(1)) <= 1, m


def test_split_heads():
    assert split_heads(3, 2) == [(0, 2), (2, 3)]
    assert split_heads(8, 4) == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert split_heads(3, 8)[3:] == [(3, 3)] * 5  # more nodes than heads: some hold none


def test_the_plan_of_a_real_artifact_manifest(artifact, tmp_path):
    import json

    from ellm.numa.plan import weights_of_manifest

    manifest = json.loads((artifact / "manifest.json").read_text())
    weights = weights_of_manifest(manifest)
    layers = manifest["config"]["n_layers"]
    assert sum(w.heads is not None for w in weights) == layers
    # 4 matmuls a layer and the output head: the tied embedding table, or its split parts (hot and cold rows)
    head = [w.name for w in weights if not w.name.startswith("blk.")]
    assert len(weights) == 4 * layers + len(head) and head in (["token_embd.weight"],
                                                              ["token_embd.weight.hot", "token_embd.weight.cold"])
    for cores in ([2], [1, 1], [4, 4, 4, 4]):
        plan = plan_layout(weights, manifest["config"]["n_kv_heads"], read_topology(make_sysfs(tmp_path / str(len(cores)), cores)))
        assert plan.imbalance() < 0.05
