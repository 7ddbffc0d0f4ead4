"""The sensitivity analysis's pieces against independent references: the float model against the float64
NumPy model, the KL against a float64 softmax, the block-store reads against the test suite's own model of the
cache quantisers, the planner against brute force; then a whole analysis of a tiny model, cached."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from kvcache import quantise_ref
from reference import NumpyLlama
from synthetic import write_model

from ellm.compiler.gguf_file import GGUFFile
from ellm.compiler.import_llama import import_llama
from ellm.config import ModelConfig
from ellm.errors import EllmError
from ellm.kv.plan import KVType
from ellm.precision.divergence import Reference
from ellm.precision.kv_read import BlockReader, hadamard, store_values
from ellm.precision.model import FloatModel, LayerEdit, round_activations
from ellm.precision.planner import Choice, Decision, solve


def _kl64(z_ref: np.ndarray, z: np.ndarray) -> np.ndarray:
    a = z_ref.astype(np.float64)
    b = z.astype(np.float64)
    la = a - np.log(np.exp(a - a.max(1, keepdims=True)).sum(1, keepdims=True)) - a.max(1, keepdims=True)
    lb = b - np.log(np.exp(b - b.max(1, keepdims=True)).sum(1, keepdims=True)) - b.max(1, keepdims=True)
    return (np.exp(la) * (la - lb)).sum(1)


@pytest.mark.parametrize("noise", [1e-3, 3e-2, 1.0])
def test_kl_matches_float64(noise):
    rng = np.random.default_rng(0)
    z = (rng.standard_normal((70, 3000)) * 4).astype(np.float32)
    z2 = z + (rng.standard_normal(z.shape) * noise).astype(np.float32)
    ref = Reference(z, rows=16)
    np.testing.assert_allclose(ref.kl(z2), _kl64(z, z2), rtol=2e-3, atol=1e-9)
    assert np.all(ref.kl(z) == 0)


def test_block_store_matches_the_cache_quantisers():
    rng = np.random.default_rng(1)
    x = rng.standard_normal((256, 3, 64)).astype(np.float16).astype(np.float32)  # [n, Hkv, hd]
    for t in (KVType.Q8, KVType.Q4):
        k = store_values(x, "k", t, 64)
        for b in range(4):
            for h in range(3):
                blk = x[64 * b : 64 * b + 64, h]  # [64 tokens, hd]: rows of the quantiser are channels
                np.testing.assert_array_equal(k[64 * b : 64 * b + 64, h], quantise_ref(blk.T, t)[0].T)
        v = store_values(x, "v", t, 64)
        np.testing.assert_array_equal(v[:, 1], quantise_ref(x[:, 1], t)[0])
    # a query reads the store for blocks before the recent tier, the float16 ring from there on
    r = BlockReader("k", KVType.Q4, 64, 2)
    got = r(x, 200)  # query block 3: blocks 0 and 1 from the store, 2 and 3 from the ring
    np.testing.assert_array_equal(got[:128], store_values(x[:128], "k", KVType.Q4, 64))
    np.testing.assert_array_equal(got[128:], x[128:])
    np.testing.assert_array_equal(BlockReader("v", KVType.Q8)(x, 100), x)  # block 1: all recent
    # pinned blocks come from the ring; rotated keys are quantised in the Hadamard basis and rotated back
    r = BlockReader("k", KVType.Q4, 64, 2, pinned=1, rotate=True)
    got = r(x, 200)
    hm = hadamard(64)
    np.testing.assert_array_equal(got[:64], x[:64])
    for h in range(3):
        blk = x[64:128, h] @ hm  # [64 tokens, hd] in the rotated basis
        np.testing.assert_allclose(got[64:128, h], quantise_ref(blk.T, KVType.Q4)[0].T @ hm, atol=1e-5)
    np.testing.assert_allclose(hm @ hm, np.eye(64), atol=1e-6)
    assert not BlockReader("v", KVType.Q4, rotate=True).rotate  # values are never rotated


def test_float_model_matches_float64_reference(tmp_path):
    path = write_model(tmp_path / "m.gguf", n_layers=2)
    gf = GGUFFile(path)
    model = FloatModel(gf, ModelConfig.from_gguf(gf), max_ctx=512)
    ids = np.random.default_rng(0).integers(0, 320, 200)
    xs, kvs = model.run(ids, keep_kv=True)
    want = NumpyLlama(path, kv_dtype="float16").forward(ids)
    got = model.logits(xs[-1])
    assert np.abs(got - want).max() <= 2e-4 * np.abs(want).max()
    # re-running from a layer with no edit reproduces the run; over a cached prefix too
    np.testing.assert_allclose(model.rerun(1, xs[1], 0, {}), xs[-1], rtol=0, atol=1e-5)
    P = 150
    past = [(k[:P], v[:P]) for k, v in kvs]
    tail = model.rerun(0, model.embed(ids)[P:], P, {}, past)
    # the tail's matmuls have 50 rows, not 200: BLAS blocks them differently, so float32 sums round apart
    # (2.8e-5 on Zen 3's AVX2 kernels at |x| up to 9.4: about 30 ulps)
    np.testing.assert_allclose(tail, xs[-1][P:], rtol=0, atol=8e-6 * np.abs(xs[-1]).max())
    # an edit changes the output; 16-bit activation rounding barely does, 8-bit more
    d16 = np.abs(model.rerun(0, xs[0], 0, {0: LayerEdit(act_bits=16)}) - xs[-1]).max()
    d8 = np.abs(model.rerun(0, xs[0], 0, {0: LayerEdit(act_bits=8)}) - xs[-1]).max()
    assert 0 < d16 < d8 / 50


def test_round_activations():
    x = np.random.default_rng(2).standard_normal((4, 64)).astype(np.float32)
    r = round_activations(x, 8)
    step = np.abs(x.reshape(4, 2, 32)).max(-1, keepdims=True) / 127
    assert np.all(np.abs(r - x).reshape(4, 2, 32) <= step / 2 + 1e-7)


def test_planner_is_exact():
    rng = np.random.default_rng(3)
    ds = []
    for j in range(6):
        cs = [Choice("src", int(rng.integers(800, 1000)), 0.0)]
        cs += [Choice(f"t{i}", int(rng.integers(300, 800)), float(rng.random())) for i in range(2)]
        ds.append(Decision(f"d{j}", "weights", j, (f"d{j}",), tuple(cs)))
    cheapest = sum(min(c.bytes for c in d.choices) for d in ds)
    with pytest.raises(EllmError, match="no plan fits"):
        solve(ds, cheapest - 1)
    for budget in (cheapest + 2, cheapest + 500, cheapest + 1500, 6000):  # + 2: six costs rounded up
        best = min(((sum(d.choices[i].kl for d, i in zip(ds, p)), p) for p in itertools.product(range(3), repeat=6)
                    if sum(d.choices[i].bytes for d, i in zip(ds, p)) <= budget * (1 - 6 / 20000)), default=None)
        picks = solve(ds, budget)
        assert sum(d.choices[i].bytes for d, i in zip(ds, picks)) <= budget
        if best is not None:  # exact up to costs rounded up to budget / 20000
            assert sum(d.choices[i].kl for d, i in zip(ds, picks)) <= best[0] + 1e-12


def test_analysis_of_a_tiny_model_is_cached(tmp_path, monkeypatch):
    from ellm.precision import weight_infos
    from ellm.precision.analysis import AnalysisSettings, load_or_analyse
    from ellm.precision.calibration import Calibration
    from ellm.runtime.tokenizer import Tokenizer

    monkeypatch.setenv("ELLM_CACHE", str(tmp_path / "cache"))
    path = write_model(tmp_path / "m.gguf", n_layers=2, types={"down": 8})  # Q8_0 down: Q6_K... candidates
    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    infos = weight_infos(import_llama(gf, cfg))
    settings = AnalysisSettings(tokens=128, seq=64, stride=1, kv_ctx=256, kv_scored=64)
    text = Calibration("test", "the then thin that other " * 400)
    table = load_or_analyse(gf, cfg, Tokenizer.from_gguf(gf), infos, text, settings)
    kinds = {(m.kind, m.type) for m in table.measurements}
    assert ("down", "Q4_0") in kinds and ("down", "Q6_K") in kinds and ("q", "Q4_0") in kinds
    assert {("k_cache", "q8"), ("k_cache", "q4"), ("v_cache", "q4"), ("activations", "int8"), ("head", "Q4_1")} <= kinds
    for m in table.measurements:
        assert m.kl >= 0 and 0 <= m.top1 <= 1
    # read budgets: at 256 tokens every query's window covers the context, so top-K reads are dense reads
    reads = [m for m in table.measurements if m.kind == "reads"]
    assert {(m.layer, m.type) for m in reads} == {(i, t) for i in range(2) for t in ("top12", "top4")}
    assert max(m.kl for m in reads) < 1e-9
    # lower precision hurts more, on average over the layers
    kl = lambda kind, t: sum(m.kl for m in table.measurements if (m.kind, m.type) == (kind, t))  # noqa: E731
    assert kl("k_cache", "q4") > kl("k_cache", "q8") and kl("down", "Q4_0") > kl("down", "Q6_K")
    # split heads: the likeliest tokens' rows kept; keeping half the rows costs less KL than keeping 16
    from ellm.precision.analysis import hot_sizes

    sizes = hot_sizes(cfg.vocab_size)
    assert sizes == [16, 32, 64, 80, 128, 160] and len(table.vocab_order) == cfg.vocab_size // 2
    split = [table.kl(infos[-1].name, f"Q4_0/{n}") for n in sizes]
    assert split[-1] < split[0] <= table.kl(infos[-1].name, "Q4_0") * 1.05
    again = load_or_analyse(gf, cfg, Tokenizer.from_gguf(gf), infos, text, settings, log=print)
    assert again.measurements == table.measurements and again.seconds == table.seconds  # from the cache


def test_plan_of_a_tiny_model_under_budgets(tmp_path, monkeypatch):
    """Decisions group fused siblings, a user-fixed cache type is the only choice of its side, and a smaller
    budget never gets a lower predicted KL."""
    from ellm.kv.attention import AttentionConfig
    from ellm.precision import weight_infos
    from ellm.precision.analysis import AnalysisSettings, load_or_analyse
    from ellm.precision.calibration import Calibration
    from ellm.precision.planner import KVGeometry, decisions, plan_bytes, to_plan
    from ellm.runtime.tokenizer import Tokenizer

    monkeypatch.setenv("ELLM_CACHE", str(tmp_path / "cache"))
    path = write_model(tmp_path / "m.gguf", n_layers=2, types={"q": 8, "k": 8, "v": 8})  # Q8_0 attention
    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    infos = weight_infos(import_llama(gf, cfg))
    settings = AnalysisSettings(tokens=128, seq=64, stride=1, kv_ctx=256, kv_scored=64)
    table = load_or_analyse(gf, cfg, Tokenizer.from_gguf(gf), infos, Calibration("t", "the then thin that " * 400), settings)
    kv = KVGeometry(cfg.n_kv_heads, cfg.head_dim)
    ds = decisions(infos, table, cfg.n_layers, kv, 256, AttentionConfig())
    names = [d.name for d in ds]
    assert "blk.0.q+k+v" in names and "blk.0.gate+up" in names and "blk.1.kv" in names
    qkv = ds[names.index("blk.0.q+k+v")]
    assert [c.type for c in qkv.choices] == ["Q8_0", "Q6_K", "Q4_1", "Q4_K", "Q4_0"]  # d = 256: K-quants fit
    fixed = decisions(infos, table, cfg.n_layers, kv, 256, AttentionConfig(), fixed_k=KVType.Q8)
    assert all(c.type.startswith("q8/") for d in fixed if d.kind == "kv" for c in d.choices)
    # a layer's KV choices: every K type, V type and read budget, bytes falling with each
    kv0 = ds[names.index("blk.0.kv")]
    assert {c.type for c in kv0.choices} >= {"f16/f16/22", "q4/q4/22", "q4/q4/4", "q8/f16/12"}
    by = {c.type: c.bytes for c in kv0.choices}
    assert by["q4/q4/22"] < by["q8/q4/22"] < by["f16/f16/22"]
    full = sum(d.choices[0].bytes for d in ds)
    last = -1.0
    for ratio in (1.0, 0.85, 0.7):
        picks = solve(ds, int(ratio * full))
        plan = to_plan(ds, picks, cfg.n_layers, "test")
        assert plan_bytes(ds, picks) <= ratio * full
        assert plan.predicted_kl >= last
        last = plan.predicted_kl
        plan.check(infos, cfg.n_layers)
    assert dict(plan.weights)  # at 70% something was lowered
    head = ds[names.index(infos[-1].name)]
    splits = [c for c in head.choices if c.split is not None]
    assert splits and all(c.bytes < head.choices[0].bytes and c.split.cold.name == c.type.split("/")[0] for c in splits)
    # a plan that picks a split carries it: force one by leaving the head only that choice
    forced = [Decision(d.name, d.kind, d.layer, d.parts, (splits[0],)) if d is head else d for d in ds]
    plan = to_plan(forced, [0] * len(forced), cfg.n_layers, "test")
    assert plan.head_split == splits[0].split and not any(n == head.name for n, _ in plan.weights)
    assert plan.weight_bytes(infos) == sum(c.bytes for d in forced if d.kind == "weights" for c in d.choices[:1])
    plan.check(infos, cfg.n_layers)
