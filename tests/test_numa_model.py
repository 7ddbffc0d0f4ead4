"""The NUMA / across-machines bandwidth model (ellm/numa/model.py): its byte counts against the compiler's
own, and the orderings and limits any such model must respect."""

from __future__ import annotations

import json

import pytest
from gguf import GGMLQuantizationType as G

from ellm.numa.model import Link, Machine, Workload, collective_bytes_per_token, tokens_per_s_across, tokens_per_s_one_machine
from ellm.synth.shapes import SHAPES, ModelShape
from ellm.synth.type_mix import TYPE_MIXES, TypeMix

SMOLLM2 = Workload.of(ModelShape("smollm2-135m", 30, 576, 9, 3, 64, 1536, 49152, tied=True), TypeMix("q4_1", G.Q4_1, G.Q8_0))


def test_smollm2_bytes_are_what_the_compiler_counts(model_path):
    from ellm.compiler.inspect import inspect_model

    info = json.loads(inspect_model(model_path, as_json=True))
    # inspect counts the norms' float32 vectors too (~0.1%)
    assert SMOLLM2.weight_bytes == pytest.approx(info["decode_weight_bytes_per_token"], rel=3e-3)
    assert SMOLLM2.kv_bytes_per_token == info["kv_bytes_per_token_f16"]


@pytest.mark.parametrize("w", [SMOLLM2, Workload.of(SHAPES["llama-8b"], TYPE_MIXES["q4_k_m"])], ids=lambda w: w.name)
def test_placements_order_and_limits(w):
    one = tokens_per_s_one_machine(w, Machine(1, 100.0, 30.0, barrier_us=0.0), 4096)
    assert one["first_touch"] == one["interleave"] == one["plan"] == pytest.approx(100e9 / w.step_bytes(4096))
    two = tokens_per_s_one_machine(w, Machine.from_distances(2, 100.0, 32, barrier_us=0.0), 4096)
    assert two["plan"] > two["interleave"] > two["first_touch"]
    assert two["plan"] == pytest.approx(2 * one["plan"])  # each socket reads half, locally
    # links as fast as memory: first touch is one controller's bandwidth, interleave as good as the plan
    fast = tokens_per_s_one_machine(w, Machine(2, 100.0, 1e6, barrier_us=0.0), 4096)
    assert fast["first_touch"] == pytest.approx(one["plan"]) and fast["interleave"] == pytest.approx(fast["plan"])
    # barriers cost every placement the same time
    slow = tokens_per_s_one_machine(w, Machine.from_distances(2, 100.0, 32, barrier_us=5.0), 4096)
    assert 1 / slow["plan"] - 1 / two["plan"] == pytest.approx(w.kernels_per_token * 5e-6)


def test_collective_traffic_is_counted_per_all_reduce():
    # 2 machines: per layer 2 all-reduces of 576 floats, each worker sending half of each twice (ring reduce-
    # scatter + all-gather), then half of the 49,152 logits
    assert collective_bytes_per_token(SMOLLM2, 2) == 30 * 2 * (2 * 0.5 * 576 * 4) + 0.5 * 49152 * 4
    assert collective_bytes_per_token(SMOLLM2, 1) == 0


def test_across_machines_pays_off_only_for_a_fast_link_and_a_large_model():
    big = Workload.of(SHAPES["llama-8b"], TYPE_MIXES["q4_k_m"])
    rdma, tcp = Link("rdma", 12.5, 3.0), Link("tcp", 1.25, 50.0)
    base = tokens_per_s_across(big, 300.0, 1, tcp, 4096)["tokens_per_s"]
    assert base == tokens_per_s_across(big, 300.0, 1, rdma, 4096)["tokens_per_s"]  # one machine: no link
    assert tokens_per_s_across(big, 300.0, 2, rdma, 4096)["tokens_per_s"] > 1.8 * base
    assert tokens_per_s_across(big, 300.0, 4, tcp, 4096)["tokens_per_s"] < base  # latency-bound
    # a small model: every link's latency costs more than the memory time it saves
    small = tokens_per_s_across(SMOLLM2, 300.0, 1, rdma, 4096)["tokens_per_s"]
    assert tokens_per_s_across(SMOLLM2, 300.0, 2, rdma, 4096)["tokens_per_s"] < small
    r = tokens_per_s_across(big, 300.0, 2, rdma, 4096)
    assert 1 / r["tokens_per_s"] == pytest.approx(r["memory_s"] + r["latency_s"] + r["transfer_s"])
