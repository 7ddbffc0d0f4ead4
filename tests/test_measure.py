"""The timing harness shared by the tuner and bench/kernels.py: one-token kernels reread their bytes after
what a decode step reads (cold where the step is unknown or larger than the caches), chunks hot, and kernels
that read the KV cache step through its layers."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
from kernels import PRESET, matmul_request, select_rule
from kvcache import cache_attrs, pinned_extra
from synthetic import write_model
from test_schedule_knobs import REQUESTS

from ellm.autotune.measure import (COLD_CACHES, COPY_MEMORY_SHARE, WEIGHTS, Workload, argument_sets, inputs, kv_read_bytes,
                                   kv_steps, param_names, reuse_bytes, streamed, weight_bytes)
from ellm.autotune.tuner import lowered_model, model_workload
from ellm.compiler.build import CompileOptions
from ellm.compiler.inspect import inspect_model
from ellm.runtime.hugepages import HUGE
from ellm.kv.plan import KVPlan, KVType
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
    sets = argument_sets(func, args, reuse_bytes(Workload(), llc))
    assert len(sets) * nbytes >= COLD_CACHES * llc
    w = [i for i, n in enumerate(param_names(func)) if n.startswith("w_")][0]
    assert len({id(s[w]) for s in sets}) == len(sets)  # each set its own copy of the weights
    assert len(argument_sets(func, args, 0)) == 1
    # the copies lie one after another on 2 MiB pages, as the engine holds its weights; every streamed buffer
    # of every set is its own copy of the original, never the original itself
    starts = [np.from_dlpack(s[w]).ctypes.data for s in sets]
    assert starts[0] % HUGE == 0 and all(b > a for a, b in zip(starts, starts[1:]))
    for i in streamed(func, args):
        assert len({np.from_dlpack(s[i]).ctypes.data for s in sets} | {np.from_dlpack(args[i]).ctypes.data}) == len(sets) + 1
        assert all(np.array_equal(np.from_dlpack(s[i]), args[i].numpy()) for s in sets)


def test_a_bench_times_one_token_kernels_at_the_steps_reuse_distance():
    from ellm.autotune.runner import KernelBench

    req = matmul_request(QuantType.Q4_1, 256, 512, m=1, layout="tile16", act_bits=8)
    rule = select_rule(req, PRESET)
    nbytes = weight_bytes(_func(req), inputs(_func(req), req, Workload(), np.random.default_rng(0)))
    bench = KernelBench(rule.name, req, PRESET.name, Workload(step_bytes=5 * nbytes))
    bench.time(lambda *a: None)
    assert len(bench.sets) == 5  # a pass reads the step's bytes: 5 copies of the weights


def test_bytes_are_reread_after_what_a_decode_step_reads():
    llc = 1 << 20
    assert reuse_bytes(Workload(step_bytes=3 * llc), llc) == 3 * llc
    assert reuse_bytes(Workload(step_bytes=100 * llc), llc) == COLD_CACHES * llc  # cold by then
    assert reuse_bytes(Workload(), llc) == COLD_CACHES * llc  # no model: cold


def test_a_decode_step_reads_every_weight_and_the_kv_blocks_of_every_layer(tmp_path):
    """At a context whose blocks are all read, the step's bytes are `ellm inspect`'s weight bytes per token
    and its KV bytes per token times the context; at a long one, the sparse selection reads less."""
    model = write_model(tmp_path / "m.gguf", n_layers=3)
    info = json.loads(inspect_model(model, as_json=True))
    cfg, g, _ = lowered_model(model, PRESET, CompileOptions(precision="source"))  # inspect's plan
    wl = model_workload(Workload(ctx=256), cfg, g)
    assert wl.layers == 3
    kv = info["kv_bytes_per_token"]
    assert wl.step_bytes == info["decode_weight_bytes_per_token"] + int(kv * 256) + pinned_extra(model, kv)
    long = model_workload(Workload(ctx=16384), cfg, g).step_bytes
    assert wl.step_bytes < long < info["decode_weight_bytes_per_token"] + info["kv_bytes_per_token"] * 16384


def _attention_func(req):
    rule = select_rule(req, PRESET)
    return rule.build_kernel(req, PRESET, rule.default_knobs(req, PRESET))


def test_kernels_that_read_the_cache_step_through_its_layers():
    req, _ = REQUESTS["attention_decode"]  # a uniform plan of 2 layers
    assert req.m == 1
    func = _attention_func(req)
    wl = Workload(ctx=256)
    args = inputs(func, req, wl, np.random.default_rng(0))
    names = param_names(func)
    li = names.index("layer")
    steps = kv_steps(req)
    assert steps == [{"layer": 0, "kslot": 0, "vslot": 0}, {"layer": 1, "kslot": 1, "vslot": 1}]
    read = kv_read_bytes(req, wl)
    sets = argument_sets(func, args, COLD_CACHES << 20, steps=steps, read=read)
    assert sorted({s[li] for s in sets}) == [0, 1]
    # one-token attention reads its cache cold: copies of the whole cache, each read layer by layer, until a
    # pass reads COLD_CACHES x the cache of what the calls read, and no (copy, layer) slice twice in a pass
    rot = streamed(func, args)
    assert rot and not {names[i] for i in rot} & {"q", "out", "attn"}
    copies = -(-COLD_CACHES * (1 << 20) // (read * 2))
    assert copies > 1 and len(sets) == copies * 2
    assert len({(id(s[rot[0]]), s[li]) for s in sets}) == len(sets)
    assert len(argument_sets(func, args, 0, steps=steps, read=read)) == 2
    # the copies stay within their share of the memory: fewer of them, still every layer
    state = sum(args[i].numpy().nbytes for i in rot)
    capped = argument_sets(func, args, COLD_CACHES << 20, steps=steps, read=read, memory=int(3 * state / COPY_MEMORY_SHARE))
    assert len(capped) == 3 * 2


def test_each_layer_reads_its_own_slots_of_the_typed_stores():
    """With keys of layers 0-1 in q8 and 2-4 in q4, the q4-key kernel serves layers 2, 3, 4: slots 0, 1, 2 of
    the q4 key store and 2, 3, 4 of the value store (every call once read slot 0: one layer's blocks,
    re-read for every layer, hot)."""
    plan = KVPlan(2, 64, (KVType.Q8,) * 2 + (KVType.Q4,) * 3, (KVType.Q4,) * 5, ring=7)
    req, _ = REQUESTS["attention_decode"]
    req = dataclasses.replace(req, attrs=tuple(sorted({**dict(req.attrs), **dict(cache_attrs(plan, 3))}.items())))
    steps = kv_steps(req)
    assert steps == [{"layer": i, "kslot": i - 2, "vslot": i} for i in (2, 3, 4)]
    func = _attention_func(req)
    args = inputs(func, req, Workload(ctx=256), np.random.default_rng(0))
    names = param_names(func)
    assert [args[names.index(n)] for n in ("layer", "kslot", "vslot")] == [2, 0, 2]  # the first layer it serves
    sets = argument_sets(func, args, 0, steps=steps)
    assert [tuple(s[names.index(n)] for n in ("layer", "kslot", "vslot")) for s in sets] == [(2, 0, 2), (3, 1, 3), (4, 2, 4)]


def test_attention_reads_the_blocks_its_sparse_selection_takes():
    """Bytes per call from the block layout: q8 keys (64 x 64 codes and a float16 min and scale per channel,
    4352 bytes a block and head), q4 values (64 x 64 nibbles and a min and scale per key, 2304), 2 heads.
    At 256 tokens every block is read; at 8192, the sparse defaults read 1 sink block, 22 top-K blocks and
    512 + 0 window keys (31 blocks) and bound the 119 blocks past the sinks (their key minima and scales)."""
    req, _ = REQUESTS["attention_decode"]
    per_block = 2 * (4352 + 2304)
    assert kv_read_bytes(req, Workload(ctx=256)) == 4 * per_block
    assert kv_read_bytes(req, Workload(ctx=8192)) == 31 * per_block + 119 * 2 * (2 * 64 * 2)
    assert kv_read_bytes(*REQUESTS["attention_input"][:1], Workload()) is None


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
        steps = [{"layer": i, "kslot": 0, "vslot": i} for i in range(layers)]
        sets = argument_sets(func, args, COLD_CACHES * llc, steps=steps)
        copies = -(-COLD_CACHES * llc // nbytes)
        assert len(sets) == max(copies, layers)
        assert sorted({s[li] for s in sets}) == list(range(layers))
        assert len({id(s[w]) for s in sets}) == min(copies, len(sets))


def test_a_new_bench_discards_a_warm_up_timing_before_its_first():
    from kernels import build

    from ellm.autotune.runner import WARMUP_PASSES, KernelBench

    req = matmul_request(QuantType.Q4_1, 256, 512, m=1, layout="tile16", act_bits=8)
    rule = select_rule(req, PRESET)
    bench = KernelBench(rule.name, req, PRESET.name, Workload())
    kernel = build(_func(req).with_attr("global_symbol", "main"))["main"]
    calls = []

    def counted(*args):
        calls.append(1)
        kernel(*args)

    first = bench.time(counted)
    n_first = len(calls)
    bench.time(counted)
    n_later = len(calls) - n_first
    assert first["passes"] == 3 and first["median"] > 0
    # a timing: one untimed pass over the sets, then 3 timed passes; the first adds WARMUP_PASSES more
    per_pass = (n_later - len(bench.sets)) // 3
    assert n_first - n_later == len(bench.sets) + WARMUP_PASSES * per_pass
