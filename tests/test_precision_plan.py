"""Precision plans: candidate types capped at the source, the quant levels, the pass that applies a plan, and
artifacts whose lowered weights compute what the re-quantised weights compute."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize as gguf_dequantize
from reference import NumpyLlama
from synthetic import write_model

import ellm
from ellm.compiler.build import CompileOptions, build_graph, compile_model
from ellm.compiler.compile_target import precision_plan
from ellm.compiler.gguf_file import GGUFFile
from ellm.compiler.graph import OpKind
from ellm.config import ModelConfig
from ellm.errors import EllmError
from ellm.kv.plan import KVPlan, KVType
from ellm.precision import HeadSplit, PrecisionPlan, candidates, quant_level_plan, weight_infos
from ellm.quant import QuantType as Q
from ellm.quant.requantize import quantize
from ellm.targets import resolve_target

PRESET = resolve_target("x86-64-v3")  # graphs only: nothing here runs code for the target


def _graphs(path, options=CompileOptions(precision="source")):
    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    return gf, cfg, *build_graph(gf, cfg, options, PRESET)


def test_candidates_never_raise_and_respect_blocks():
    assert candidates(Q.Q4_1, 576, 576) == [Q.Q4_1, Q.Q4_0]  # K-quants need rows of 256
    assert candidates(Q.Q4_1, 576, 1536) == [Q.Q4_1, Q.Q4_K, Q.Q4_0]
    assert candidates(Q.Q8_0, 49152, 576) == [Q.Q8_0, Q.Q4_1, Q.Q4_0]
    assert candidates(Q.F16, 256, 512) == [Q.F16, Q.Q8_0, Q.Q6_K, Q.Q4_1, Q.Q4_K, Q.Q4_0]
    assert candidates(Q.Q4_0, 256, 512) == [Q.Q4_0, Q.Q4_K]  # same bits per weight: allowed, never more
    for src in Q:
        if src is Q.BF16:
            continue
        for t in candidates(src, 256, 512):
            assert t is src or (t.value != src.value and _bits(t) <= _bits(src))


def _bits(t):
    from ellm.precision.plan import bits

    return bits(t)


def test_quant_levels_on_the_default_model(model_path):
    gf, cfg, g0, _ = _graphs(model_path)
    infos = weight_infos(g0)
    assert len(infos) == 7 * cfg.n_layers + 1
    l0, l1, l2 = (quant_level_plan(n, infos, cfg.n_layers) for n in (0, 1, 2))
    assert l0.weights == () and set(l0.kv_k) == set(l0.kv_v) == {KVType.F16} and l0.activations == "int16"
    # SmolLM2: Q4_1 blocks, Q8_0 tied head. Level 1 cannot raise Q4_1 attention to 8 bits: it says so
    assert l1.weights == () and set(l1.kv_k) == {KVType.Q8}
    assert "never raises" in l1.notes[0] and "blk.0.attn_q.weight" in l1.notes[0]
    # level 2: the head goes to 4 bits (Q4_1: its rows of 576 hold no K-quant super-block), Q4_1 stays Q4_1
    assert dict(l2.weights) == {"token_embd.weight": Q.Q4_1}
    assert set(l2.kv_k) == set(l2.kv_v) == {KVType.Q4} and l2.activations == "int8"
    for p in (l0, l1, l2):
        p.check(infos, cfg.n_layers)
        assert PrecisionPlan.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_a_plan_cannot_raise_or_misfit(model_path):
    gf, cfg, g0, _ = _graphs(model_path)
    infos = weight_infos(g0)
    with pytest.raises(EllmError, match="cannot be stored as Q8_0"):
        PrecisionPlan(weights=(("blk.0.attn_q.weight", Q.Q8_0),)).check(infos, cfg.n_layers)
    with pytest.raises(EllmError, match="cannot be stored as Q4_K"):
        PrecisionPlan(weights=(("blk.0.attn_q.weight", Q.Q4_K),)).check(infos, cfg.n_layers)
    with pytest.raises(EllmError, match="no weight"):
        PrecisionPlan(weights=(("blk.99.attn_q.weight", Q.Q4_0),)).check(infos, cfg.n_layers)


def test_the_pass_applies_the_plan_and_siblings_still_fuse(model_path):
    gf, cfg, g0, g_src = _graphs(model_path)
    _, _, _, g2 = _graphs(model_path, CompileOptions(quant_level=2))
    assert g2.op_counts() == g_src.op_counts()  # lowering the head changed no fusion
    head = next(op for _, op in g2.nodes() if op.kind is OpKind.LM_HEAD).weight
    embd = next(op for _, op in g2.nodes() if op.kind is OpKind.EMBEDDING).weight
    assert head.qtype is embd.qtype is Q.Q4_1  # tied: one tensor, one type
    plan = KVPlan.from_key(g2.op("kv_cache").attr("kv_plan"))
    assert set(plan.k) == set(plan.v) == {KVType.Q4}
    # an explicit cache type overrides the plan's side
    _, _, _, g3 = _graphs(model_path, CompileOptions(quant_level=2, cache_type_k="q8"))
    plan3 = KVPlan.from_key(g3.op("kv_cache").attr("kv_plan"))
    assert set(plan3.k) == {KVType.Q8} and set(plan3.v) == {KVType.Q4}


def test_mixed_kv_layers_from_a_plan(model_path):
    from ellm.compiler.compile_target import pass_context
    from ellm.compiler.pipeline import run_pipeline

    gf, cfg, g0, _ = _graphs(model_path)
    k = tuple(KVType.Q8 if i % 3 == 0 else KVType.Q4 for i in range(cfg.n_layers))
    v = tuple(KVType.F16 if i == 5 else KVType.Q4 for i in range(cfg.n_layers))
    plan = PrecisionPlan(kv_k=k, kv_v=v, origin="test")
    g = run_pipeline(g0, pass_context(CompileOptions(), PRESET, plan))
    kv = KVPlan.from_key(g.op("kv_cache").attr("kv_plan"))
    assert kv.k == k and kv.v == v


def test_lowered_float_model_matches_requantised_reference(tmp_path):
    """An F16 model at --quant-level 2 (KV and activations pinned, so only weights change): the artifact's
    logits equal a float64 model whose weights are our re-quantiser's output, dequantised by gguf."""
    types = {"q": G.F16, "k": G.F16, "v": G.F16, "o": G.F16, "gate": G.F16, "up": G.F16, "down": G.F16, "embd": G.F16}
    path = write_model(tmp_path / "f16.gguf", types=types)
    options = CompileOptions(cache_type_k="f32", cache_type_v="f32", activations="int16", quant_level=2)
    art = compile_model(path, tmp_path / "art", options).path
    manifest = json.loads((art / "manifest.json").read_text())
    lowered = manifest["precision"]["weights"]
    assert set(lowered.values()) == {"Q4_K"} and len(lowered) == 2 * 7 + 1  # d = 256, ff = 512: every row fits Q4_K
    ref = NumpyLlama(path)
    for name, t in lowered.items():
        w = ref.w[name].astype(np.float32)
        ref.w[name] = gguf_dequantize(quantize(w, Q[t]), getattr(G, t)).reshape(w.shape).astype(np.float64)
    ref.head = ref.w.get("output.weight", ref.w["token_embd.weight"])
    eng = ellm.load(art, threads=2)
    ids = list(np.random.default_rng(0).integers(0, eng.config.vocab_size, 40))
    got, want = eng.logits(ids), ref.forward(ids)
    assert np.abs(got - want).max() <= 1e-3 * max(1.0, np.abs(want).max())
    # and the source-precision reference is measurably different: the test sees the lowering
    assert np.abs(got - NumpyLlama(path).forward(ids)).max() > 1e-2 * np.abs(want).max()


def test_precision_plan_comes_from_options_only(model_path):
    gf = GGUFFile(model_path)
    cfg = ModelConfig.from_gguf(gf)
    assert precision_plan(gf, cfg, CompileOptions(precision="source")) is None
    logs: list[str] = []  # both cache types given, no budget: the source plan, without measuring anything
    assert precision_plan(gf, cfg, CompileOptions(cache_type_k="q8", cache_type_v="q4"), log=logs.append) is None
    assert logs == ["precision: source types (both cache types given: nothing to plan at the default's bytes)"]
    assert precision_plan(gf, cfg, replace(CompileOptions(), quant_level=1)).origin == "quant-level 1"
    with pytest.raises(EllmError, match="quant-level"):
        CompileOptions(quant_level=3)
    with pytest.raises(EllmError, match="kv-store"):
        CompileOptions(kv_store="rotated")


def test_precision_options_fail_clearly(tmp_path, capsys):
    from ellm.cli import main

    for argv, msg in (
        (["compile", "-o", str(tmp_path / "a"), "--precision", "source", "--budget-mb", "90"], "need the measured plan"),
        (["compile", "-o", str(tmp_path / "e"), "--quant-level", "1", "--budget-ratio", "0.9"], "need the measured plan"),
        (["compile", "-o", str(tmp_path / "b"), "--precision", "auto", "--quant-level", "1"], "pick one"),
        (["compile", "-o", str(tmp_path / "f"), "--precision", "source", "--quant-level", "2"], "pick one"),
        (["compile", "-o", str(tmp_path / "c"), "--precision", "auto", "--budget-ratio", "-1"], "must be positive"),
        (["compile", "-o", str(tmp_path / "d"), "--precision", "auto", "--calibration", str(tmp_path / "none.txt")],
         "cannot read calibration text"),
    ):
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
        assert not (tmp_path / argv[2]).exists()


def test_auto_precision_compiles_checks_and_reuses(tmp_path, monkeypatch):
    """`--precision auto` end to end on a tiny model: the plan fits its budget, is measured whole, lands in
    the manifest, and a second compile reuses the analysis and the check. (A random model's KLs are ~1e-7:
    here the sum of single-part KLs only has to get the order of magnitude; bench/sensitivity_transfer.py
    holds SmolLM2's plans to a factor of 2.)"""
    monkeypatch.setenv("ELLM_CACHE", str(tmp_path / "cache"))
    types = {"q": G.Q8_0, "k": G.Q8_0, "v": G.Q8_0, "o": G.Q8_0, "gate": G.Q8_0, "up": G.Q8_0, "down": G.Q8_0}
    path = write_model(tmp_path / "m.gguf", types=types)
    options = CompileOptions(precision="auto", budget_ratio=0.7)
    logs: list[str] = []
    art = compile_model(path, tmp_path / "a", options, log=logs.append).path
    p = json.loads((art / "manifest.json").read_text())["precision"]
    a = p["analysis"]
    assert p["origin"].startswith("auto") and p["weights"] and a["plan_bytes"] <= a["budget_bytes"]
    assert abs(a["budget_bytes"] - 0.7 * a["source_bytes"]) <= 1
    # weights: additive to the order of magnitude. KV and reads are not checked here: a random model attends
    # almost uniformly, so which blocks a bound selects (on rotated, quantised keys) is near-arbitrary and its
    # cost swings; SmolLM2's 85% plan: predicted 0.0099, measured 0.0096 (reads top-12, all KV q4)
    assert 0.25 <= a["measured_kl_weights"] / a["predicted_kl_weights"] <= 4, a
    assert 0 <= a["measured_kl_kv"] < 1e-3 and a["predicted_kl"] > a["predicted_kl_weights"]
    # the manifest's plan is the plan that was costed: its bytes add up to the planner's
    from ellm.compiler.import_llama import import_llama
    from ellm.kv.attention import AttentionConfig
    from ellm.precision.auto import fixed_bytes

    plan = PrecisionPlan.from_dict(p)
    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    infos = weight_infos(import_llama(gf, cfg))
    from ellm.runtime.artifact import Artifact

    kv = Artifact.open(art).kv_plan  # as compiled: the planned types, the default (protected) store
    assert kv.k == plan.kv_k and kv.v == plan.kv_v and kv.pinned == 1
    # the read budget was planned too: the artifact reads its per-layer top-K by default, and the bytes count it
    reads = Artifact.open(art).attention()
    assert plan.reads is not None and len(plan.reads) == cfg.n_layers
    assert [reads.for_layer(i).topk for i in range(cfg.n_layers)] == list(plan.reads)
    assert plan.weight_bytes(infos) + kv.read_bytes(8192, reads) + fixed_bytes(cfg, infos) == a["plan_bytes"]
    eng = ellm.load(art, threads=2)
    assert eng.attention == reads and ellm.load(art, threads=2, attention=AttentionConfig(topk=3)).attention.topk == 3
    assert np.isfinite(eng.logits([1, 2, 3])).all()
    logs.clear()
    compile_model(path, tmp_path / "b", options, log=logs.append)
    assert any("reusing" in line for line in logs)
    p2 = json.loads((tmp_path / "b" / "manifest.json").read_text())["precision"]
    assert p2["weights"] == p["weights"] and p2["analysis"]["measured_kl"] == a["measured_kl"]


def _split_plan(vocab: int, cold: Q = Q.Q4_0) -> PrecisionPlan:
    return PrecisionPlan(origin="test", head_split=HeadSplit(tuple(range(0, vocab, 5)), cold))


def test_split_head_graph_and_bytes(tmp_path):
    """The pass replaces the head by two row-set heads and a merge; the step reads the planned bytes."""
    from ellm.compiler.compile_target import pass_context
    from ellm.compiler.inspect import decode_weight_bytes
    from ellm.compiler.pipeline import run_pipeline

    path = write_model(tmp_path / "m.gguf")  # tied Q8_0 head, vocab 320
    gf, cfg, g0, _ = _graphs(path)
    plan = _split_plan(cfg.vocab_size)
    infos = weight_infos(g0)
    plan.check(infos, cfg.n_layers)
    base = run_pipeline(g0, pass_context(CompileOptions(), PRESET, None))
    g = run_pipeline(g0, pass_context(CompileOptions(), PRESET, plan))
    heads = [g.op(n) for n in g.names(OpKind.LM_HEAD)]
    assert [(h.weight.qtype, h.weight.rows, h.weight.layout) for h in heads] == [(Q.Q8_0, 64, "tile16"), (Q.Q4_0, 256, "tile16")]
    assert sorted(heads[0].weight.row_ids + heads[1].weight.row_ids) == list(range(cfg.vocab_size))
    (merge,) = [g.op(n) for n in g.names(OpKind.VOCAB_MERGE)]
    index = np.array(merge.vector("index").values)
    order = np.array(heads[0].weight.row_ids + heads[1].weight.row_ids)
    np.testing.assert_array_equal(order[index], np.arange(cfg.vocab_size))  # index[token] -> its logit's position
    assert g.outputs == g.names(OpKind.VOCAB_MERGE)
    embd = [g.op(n).weight for n in g.names(OpKind.EMBEDDING)][0]
    assert (embd.qtype, embd.rows, embd.row_ids) == (Q.Q8_0, cfg.vocab_size, None)  # the lookup table stays whole
    head = next(i for i in infos if i.part == "head")
    saved = head.nbytes(Q.Q8_0) - plan.head_split.nbytes(head, Q.Q8_0)
    assert saved == 256 * (272 - 144) - 4 * cfg.vocab_size  # the int32 index is read too
    assert decode_weight_bytes(base) - decode_weight_bytes(g) == saved


def test_split_head_plans_are_checked(tmp_path):
    path = write_model(tmp_path / "m.gguf")
    gf, cfg, g0, _ = _graphs(path)
    infos = weight_infos(g0)
    for split, msg in ((HeadSplit(tuple(range(0, 330, 5)), Q.Q4_0), "cannot be split"),  # ids past the vocabulary
                       (HeadSplit(tuple(range(0, 320, 5)), Q.Q8_0), "cannot be split"),  # cold not below hot
                       (HeadSplit(tuple(range(0, 320, 7)), Q.Q4_0), "cannot be split")):  # 46 rows: not whole tiles
        with pytest.raises(EllmError, match=msg):
            PrecisionPlan(origin="t", head_split=split).check(infos, cfg.n_layers)
    with pytest.raises(EllmError, match="ascending"):
        HeadSplit((3, 1), Q.Q4_0)
    plan = _split_plan(cfg.vocab_size)
    assert PrecisionPlan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


@pytest.mark.parametrize("tied", [True, False])
def test_split_head_artifact_matches_reference(tmp_path, monkeypatch, tied):
    """Compiled with a split head (tied to the embedding or its own output.weight), the artifact's logits are
    those of a float64 model whose cold rows are our re-quantiser's Q4_0 (dequantised by gguf) and whose hot
    rows are the source's; prefill and decode agree."""
    import ellm.compiler.build as build

    path = write_model(tmp_path / "m.gguf", tied=tied)
    plan = _split_plan(320)
    monkeypatch.setattr(build, "precision_plan", lambda *a, **k: plan)
    options = CompileOptions(cache_type_k="f32", cache_type_v="f32", activations="int16")
    art = compile_model(path, tmp_path / "art", options).path
    assert json.loads((art / "manifest.json").read_text())["precision"]["head_split"]["hot_rows"] == 64
    ref = NumpyLlama(path)
    w = ref.head.astype(np.float32)
    cold = np.array(plan.head_split.cold_ids(320))
    head = ref.head.copy()
    head[cold] = gguf_dequantize(quantize(w, Q.Q4_0), G.Q4_0).reshape(w.shape)[cold]
    ref.head = head
    eng = ellm.load(art, threads=2)
    ids = list(np.random.default_rng(0).integers(0, 320, 40))
    got, want = eng.logits(ids), ref.forward(ids)
    tol = 1e-3 * np.abs(want).max()
    assert np.abs(got - want).max() <= tol
    assert np.abs(got - NumpyLlama(path).forward(ids)).max() > 10 * tol  # the cold rows did change
    eng.reset()
    np.testing.assert_allclose(eng.prefill(ids[:-1]), want[-2], atol=tol, rtol=0)  # one row through both heads
    np.testing.assert_allclose(eng.decode(ids[-1]), want[-1], atol=tol, rtol=0)


def test_default_plan_falls_back_when_the_analysis_does_not_fit(tmp_path, monkeypatch):
    """A model whose float analysis would not fit in memory compiles at source types by default, with a log
    line; asked for by name, it is a clear error. Nothing is measured either way."""
    import ellm.precision.model as model

    path = write_model(tmp_path / "m.gguf")
    gf = GGUFFile(path)
    cfg = ModelConfig.from_gguf(gf)
    assert model.analysis_memory(cfg) < model.available_memory()
    monkeypatch.setattr(model, "available_memory", lambda: model.analysis_memory(cfg))  # 80% of it is too little
    monkeypatch.setenv("ELLM_CACHE", str(tmp_path / "cache"))
    logs: list[str] = []
    assert precision_plan(gf, cfg, CompileOptions(), log=logs.append) is None
    assert len(logs) == 1 and "needs about" in logs[0] and "source types" in logs[0]
    with pytest.raises(EllmError, match="--precision source"):
        precision_plan(gf, cfg, CompileOptions(precision="auto"))
    assert not (tmp_path / "cache").exists()
