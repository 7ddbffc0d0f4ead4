"""The timing harness shared by the tuner and bench/kernels.py: one-token kernels see their weights cold,
chunks hot, and kernels that read the KV cache step through its layers."""

from __future__ import annotations

import numpy as np
from kernels import PRESET, matmul_request, select_rule
from test_schedule_knobs import REQUESTS

from ellm.autotune.measure import COLD_CACHES, WEIGHTS, Workload, argument_sets, inputs, param_names, streamed, weight_bytes
from ellm.quant import QuantType


def _func(req):
    rule = select_rule(req, PRESET)
    return rule.build_kernel(req, PRESET, rule.default_knobs(req, PRESET))


def test_cold_weights_rotate_through_several_times_the_cache():
    req = matmul_request(QuantType.Q4_1, 256, 512, m=1, layout="tile16", act_bits=8)
    func = _func(req)
    args = inputs(func, req, Workload(), np.random.default_rng(0))
    nbytes = weight_bytes(func, args)
    assert nbytes > 0
    llc = 64 * nbytes
    sets = argument_sets(func, args, cold=True, llc=llc)
    assert len(sets) * nbytes >= COLD_CACHES * llc
    w = [i for i, n in enumerate(param_names(func)) if n.startswith("w_")][0]
    assert len({id(s[w]) for s in sets}) == len(sets)  # each set its own copy of the weights
    assert len(argument_sets(func, args, cold=False, llc=llc)) == 1


def test_kernels_that_read_the_cache_step_through_its_layers():
    req, preset = REQUESTS["attention_decode"]
    assert req.m == 1
    rule = select_rule(req, preset)
    func = rule.build_kernel(req, preset, rule.default_knobs(req, preset))
    args = inputs(func, req, Workload(ctx=256), np.random.default_rng(0))
    li = param_names(func).index("layer")
    sets = argument_sets(func, args, cold=True, llc=1 << 20, layers=2)
    assert sorted({s[li] for s in sets}) == [0, 1]
    # one-token attention reads its cache cold: copies of the whole cache, each read layer by layer, so no
    # (copy, layer) slice is read twice in a pass
    rot = streamed(func, args)
    names = param_names(func)
    assert rot and not {names[i] for i in rot} & {"q", "out", "attn"}
    state = sum(args[i].numpy().nbytes for i in rot)
    copies = -(-COLD_CACHES * (1 << 20) // state)
    assert copies > 1 and len(sets) == copies * 2
    assert len({(id(s[rot[0]]), s[li]) for s in sets}) == len(sets)
    assert len(argument_sets(func, args, cold=False, llc=1 << 20, layers=2)) == 2


def test_cold_weights_and_kv_layers_pair_up_rather_than_multiply():
    """attention_input has weights and a `layer`: each call takes the next copy and the next layer, so a pass
    is max(copies, layers) calls (the product was 30x slower to time on SmolLM2 with a 480 MB L3)."""
    req, preset = REQUESTS["attention_input"]
    rule = select_rule(req, preset)
    func = rule.build_kernel(req, preset, rule.default_knobs(req, preset))
    args = inputs(func, req, Workload(tokens=4, ctx=256), np.random.default_rng(0))
    names = param_names(func)
    li, nbytes = names.index("layer"), weight_bytes(func, args)
    w = [i for i, n in enumerate(names) if n.startswith(WEIGHTS)][0]
    for llc, layers in ((8 * nbytes, 3), (nbytes // 8, 5)):
        sets = argument_sets(func, args, cold=True, llc=llc, layers=layers)
        copies = -(-COLD_CACHES * llc // nbytes)
        assert len(sets) == max(copies, layers)
        assert sorted({s[li] for s in sets}) == list(range(layers))
        assert len({id(s[w]) for s in sets}) == min(copies, len(sets))
