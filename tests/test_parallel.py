"""Tensor parallelism (ellm/parallel/): the ranks' slices, the sharding pass, column-sliced weights, the shared-memory
collective, and a 2-rank Disco group on a tiny model against the single-process run, including a dead and a
silent worker."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from gguf.quants import dequantize
from synthetic import write_model

from ellm.compiler.build import CompileOptions, build_graph
from ellm.compiler.gguf_file import GGUFFile
from ellm.compiler.graph import OpKind, WeightRef
from ellm.compiler.lower import ParamSpec, weight_components
from ellm.compiler.pack_weights import _Sources, pack_param
from ellm.config import ModelConfig, RopeScaling
from ellm.errors import EllmError
from ellm.parallel.shm import ShmCommunicator, create_segment
from ellm.parallel.shard import TensorParallel
from ellm.targets import resolve_target


def smollm2_like(**kw) -> ModelConfig:
    d = dict(arch="llama", n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64, d_ff=1536,
             vocab_size=49152, ctx_train=8192, rms_eps=1e-5, rope_base=1e5, rope_dim=64, rope_neox=False,
             rope_scaling=RopeScaling(), rope_freq_factors=(), attn_bias=False,
             tied_embeddings=True)
    d.update(kw)
    return ModelConfig(**d)


# --- the slices ------------------------------------------------------------------------------------
def test_ranks_keep_whole_gqa_groups_and_cover_everything_once():
    cfg = smollm2_like()
    for world in (2, 3):
        ranks = [TensorParallel.plan(cfg, r, world) for r in range(world)]
        for key, total in (("kv_heads", 3), ("q_heads", 9), ("ff", 1536), ("vocab", 49152)):
            spans = [getattr(tp, key) for tp in ranks]
            assert spans[0][0] == 0 and spans[-1][1] == total
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        for tp in ranks:
            assert tp.n_heads == tp.n_kv_heads * cfg.group_size
            assert tp.ff[0] % 256 == 0 and tp.vocab[0] % 16 == 0
            assert sum(tp.vocab_widths) == 49152
    assert [TensorParallel.plan(cfg, r, 2).kv_heads for r in range(2)] == [(0, 2), (2, 3)]
    assert TensorParallel.plan(cfg, 1, 2).slice_config(cfg).n_heads == 3


@pytest.mark.parametrize("world, match", [(1, "at least 2 ranks, got 1"), (4, "this model has 3, too few for 4")])
def test_impossible_splits_are_refused(world, match):
    with pytest.raises(EllmError, match=match):
        TensorParallel.plan(smollm2_like(), 0, world)
    with pytest.raises(EllmError, match="attention biases"):
        TensorParallel.plan(smollm2_like(attn_bias=True), 0, 2)


# --- the pass and the packed weights -------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return write_model(tmp_path_factory.mktemp("tp") / "tiny.gguf", n_layers=2)


def _rank_graph(tiny, rank):
    gf = GGUFFile(tiny)
    cfg = ModelConfig.from_gguf(gf)
    tp = TensorParallel.plan(cfg, rank, 2)
    opts = CompileOptions(precision="source", tensor_parallel=tp)
    return gf, cfg, tp, build_graph(gf, cfg, opts, resolve_target("x86-64-v3"))[1]


@pytest.mark.parametrize("rank", [0, 1])
def test_the_pass_keeps_the_ranks_slice_and_joins_after_row_parallel_matmuls(tiny, rank):
    gf, cfg, tp, g = _rank_graph(tiny, rank)
    counts = g.op_counts()
    assert counts["allreduce"] == 1 + 2 * cfg.n_layers and counts["allgather"] == 1
    embed = g.op("embed")
    assert embed.attr("first_row") == tp.vocab[0] and embed.weight.rows == tp.vocab[1] - tp.vocab[0]
    assert g.consumers("embed") == ["embed.allreduce"]
    L, hkv, _, hd = g.op("kv_cache").out.shape
    assert (L, hkv, hd) == (cfg.n_layers, tp.n_kv_heads, cfg.head_dim)
    for name, op in g.nodes():
        if op.kind is OpKind.ALLREDUCE:
            (u,) = op.inputs
            if u.src == "embed":
                continue
            w = g.op(u.src).weight
            # the producer reads this rank's columns: its heads' outputs or its FFN rows
            assert w.col_range in ((tp.q_heads[0] * hd, tp.q_heads[1] * hd), tp.ff)
            # every consumer sees the sum, never the partial one
            assert all(c != u.src for c in g.consumers(name)) and g.consumers(u.src) == [name]
    (out,) = g.outputs
    assert g.op(out).kind is OpKind.ALLGATHER and g.op(out).out.width == cfg.vocab_size
    # the fused QKV weight holds this rank's query rows, then its key and value rows, of the three sources
    qkv = next(w for w in g.weights() if "attn_q+attn_k+attn_v" in w.name)
    q, kv = cfg.q_dim, cfg.kv_dim
    rows = [*range(tp.q_heads[0] * hd, tp.q_heads[1] * hd)]
    rows += [q + r for r in range(tp.kv_heads[0] * hd, tp.kv_heads[1] * hd)]
    rows += [q + kv + r for r in range(tp.kv_heads[0] * hd, tp.kv_heads[1] * hd)]
    assert qkv.row_ids == tuple(rows) and qkv.source_rows == q + 2 * kv


def test_the_ranks_hold_the_model_once(tiny):
    gf = GGUFFile(tiny)
    cfg = ModelConfig.from_gguf(gf)
    whole = build_graph(gf, cfg, CompileOptions(precision="source"), resolve_target("x86-64-v3"))[1]
    full = sum(w.nbytes for w in whole.weights())
    parts = [sum(w.nbytes for w in _rank_graph(tiny, r)[3].weights()) for r in range(2)]
    assert sum(parts) == full  # the tied table's rows serve both the lookup and the head of their rank
    assert abs(parts[0] - parts[1]) / max(parts) < 0.05


def test_column_slices_are_the_gguf_blocks_of_those_columns(tiny):
    gf = GGUFFile(tiny)
    name = "blk.0.ffn_down.weight"
    info = gf.info(name)
    full = dequantize(gf.raw(name), info.type_id).reshape(info.rows, info.cols)
    src = _Sources(gf)
    qtype = gf.weight_format(name).qtype
    for c0, c1 in ((0, 256), (256, 512), (96, 160)):
        part = dequantize(np.ascontiguousarray(src.raw(name, qtype, None, (c0, c1))), info.type_id)
        np.testing.assert_array_equal(part.reshape(info.rows, c1 - c0), full[:, c0:c1])
    # requantised (a lower type): block-wise, a slice quantises as the whole does
    from ellm.quant import QuantType

    lo = src.raw(name, QuantType.Q4_0, None, (256, 512))
    whole = src.raw(name, QuantType.Q4_0)
    np.testing.assert_array_equal(lo, whole[:, whole.shape[1] // 2:])


def test_packed_column_slices_are_slices_of_the_packed_whole(tiny):
    gf = GGUFFile(tiny)
    name = "blk.1.ffn_down.weight"
    info, qtype = gf.info(name), gf.weight_format(name).qtype
    part = WeightRef(name, qtype, info.rows, 256, (name,), col_range=(256, 512))
    whole = WeightRef(name, qtype, info.rows, 512, (name,))
    for (comp, dtype, shape), (_, _, wshape) in zip(weight_components(part), weight_components(whole)):
        spec = lambda w, shp: ParamSpec(f"{name}:{comp}", dtype, shp, w.sources, qtype.name, comp,  # noqa: E731
                                        w.layout, None, w.col_range)
        a, b = pack_param(gf, spec(part, shape)), pack_param(gf, spec(whole, wshape))
        np.testing.assert_array_equal(a, b[:, b.shape[1] // 2:])


# --- the collective ----------------------------------------------------------------------------------
def _group(tmp_path, world=2, slot=1 << 16, timeout=5.0):
    path = str(tmp_path / "seg")
    create_segment(path, world, slot)
    return [ShmCommunicator(path, r, world, slot, timeout) for r in range(world)]


def _on_threads(fns):
    out, threads = [None] * len(fns), []
    for i, f in enumerate(fns):
        threads.append(threading.Thread(target=lambda i=i, f=f: out.__setitem__(i, f())))
        threads[-1].start()
    for t in threads:
        t.join(30)
    return out


def test_allreduce_and_allgather_agree_on_every_rank(tmp_path):
    comms = _group(tmp_path, world=3)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((4, 40)).astype(np.float32) for _ in comms]

    def rank(c):
        outs = []
        for step in range(5):  # more calls than generations: slots are reused safely
            out = np.empty_like(xs[c.rank])
            c.allreduce(xs[c.rank] * (step + 1), out)
            outs.append(out)
        gathered = np.empty((4, 6 + 7 + 8), np.float32)
        c.allgather(xs[c.rank][:, : 6 + c.rank], (6, 7, 8), gathered)
        return outs, gathered

    res = _on_threads([lambda c=c: rank(c) for c in comms])
    for step in range(5):
        want = (xs[0] * (step + 1) + xs[1] * (step + 1)) + xs[2] * (step + 1)  # rank order
        for outs, _ in res:
            np.testing.assert_array_equal(outs[step], want)
    want = np.concatenate([xs[0][:, :6], xs[1][:, :7], xs[2][:, :8]], axis=1)
    for _, g in res:
        np.testing.assert_array_equal(g, want)
    # every rank reads what the others published: 5 all-reduces of [4, 40] float32, then their gathered columns
    assert comms[0].traffic.calls == 6 and comms[0].traffic.bytes_in == 5 * 2 * 640 + (7 + 8) * 4 * 4


def test_a_silent_peer_times_out_and_a_failed_one_stops_the_rest(tmp_path):
    a, b = _group(tmp_path, timeout=0.5)
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match="rank 1 did not answer within 0.5 s"):
        a.allreduce(np.ones(4, np.float32), np.empty(4, np.float32))
    assert time.perf_counter() - t < 5
    (tmp_path / "2").mkdir()
    a2, b2 = _group(tmp_path / "2", timeout=30)
    b2.fail("boom")
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match="rank 1 failed"):
        a2.allreduce(np.ones(4, np.float32), np.empty(4, np.float32))
    assert time.perf_counter() - t < 5
    assert a2.errors() == [f"rank 1 (pid {os.getpid()}): boom"]


def test_a_dead_peer_is_seen_at_once(tmp_path):
    a, b = _group(tmp_path, timeout=60)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    b._pid[1] = proc.pid  # rank 1 "is" that process
    proc.kill()
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match=f"rank 1 \\(pid {proc.pid}\\) died"):
        a.allreduce(np.ones(4, np.float32), np.empty(4, np.float32))
    assert time.perf_counter() - t < 5  # a zombie (not yet reaped) counts as dead
    proc.wait()


def _tcp_group(world, timeout=10.0):
    from ellm.parallel.tcp import TcpCommunicator, free_local_addresses, parse_addresses

    addrs = parse_addresses(free_local_addresses(world))
    return _on_threads([lambda r=r: TcpCommunicator(addrs, r, timeout) for r in range(world)])


def test_tcp_exchanges_large_payloads_both_ways_and_in_rank_order():
    comms = _tcp_group(3)
    rng = np.random.default_rng(1)
    # 8 MB each way at once: more than the sockets buffer, so sends and receives must interleave
    xs = [rng.standard_normal(2 << 20).astype(np.float32) for _ in comms]

    def rank(c):
        out = np.empty_like(xs[c.rank])
        c.allreduce(xs[c.rank], out)
        small = np.empty(3, np.float32)
        for k in range(20):  # back-to-back calls: a fast rank's next message must not be read into this one
            c.allreduce(np.full(3, k + c.rank, np.float32), small)
        return out, small

    res = _on_threads([lambda c=c: rank(c) for c in comms])
    want = (xs[0] + xs[1]) + xs[2]
    for out, small in res:
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(small, np.full(3, 3 * 19 + 3, np.float32))
    for c in comms:
        c.close()


def test_tcp_peer_that_fails_or_stays_silent_is_an_error():
    a, b = _tcp_group(2, timeout=0.5)
    with pytest.raises(RuntimeError, match="rank 1 did not answer within 0.5 s"):
        a.allreduce(np.ones(4, np.float32), np.empty(4, np.float32))
    a.close()
    b.close()
    a, b = _tcp_group(2, timeout=30)
    b.fail("boom")  # closes its connections
    t = time.perf_counter()
    with pytest.raises(RuntimeError, match="rank 1 closed its connection"):
        a.allreduce(np.ones(4, np.float32), np.empty(4, np.float32))
    assert time.perf_counter() - t < 5 and b.errors() == [f"rank 1 (pid {os.getpid()}): boom"]
    a.close()
