"""The tuner times real kernels, keeps the fastest knobs per kernel, and compile applies them."""

from __future__ import annotations

import json
from dataclasses import replace

from kernels import PRESET, matmul_request, select_rule
from synthetic import write_model

from ellm.autotune import TuningDatabase, TuningRecord
from ellm.autotune.confirm import CONFIRM_ROUNDS
from ellm.autotune.measure import last_level_cache, reuse_bytes
from ellm.autotune.tuner import TuneOptions, Workload, tune_model
from ellm.compiler.build import CompileOptions, compile_model
from ellm.compiler.inspect import inspect_model
from ellm.quant import QuantType

SOURCE = CompileOptions(precision="source")  # the step bytes are `ellm inspect`'s: source types, rule KV


def test_database_keeps_the_fastest(tmp_path):
    db = TuningDatabase(tmp_path / "db.jsonl")
    rec = dict(target="znver4", cpu="x", kernel="k", rule="gemv", threads=2)
    assert db.add(TuningRecord(knobs={"rows_per_task": 8}, seconds=2e-5, **rec))
    assert not db.add(TuningRecord(knobs={"rows_per_task": 4}, seconds=3e-5, **rec))
    assert db.add(TuningRecord(knobs={"rows_per_task": 16}, seconds=1e-5, **rec))
    db.save()
    again = TuningDatabase.open(tmp_path / "db.jsonl")
    assert again.best("znver4", "k", "gemv").knobs == {"rows_per_task": 16}


def test_tune_then_compile_uses_the_tuned_knobs(tmp_path):
    model = write_model(tmp_path / "m.gguf", n_layers=1)
    """Tunes for this host's target (tuning runs the kernels)."""
    target = PRESET.name
    # three decode kernels, one per rule: prefill kernels and the other matmuls go through the same search, and
    # tuning all six decode kernels made this the suite's longest test (~200 s on 2 Zen 3 cores)
    db = tune_model(model, tmp_path / "tune.jsonl", target=target, threads=2, kernels="(attention.*|matmul_q4_1_256x256)_m1_",
                    options=TuneOptions("random", trials=2, workers=0), workload=Workload(tokens=32, ctx=256),
                    compile_options=SOURCE)
    records = db.records()
    # every kernel was timed as the model's decode step reads: weights and the KV blocks at the context
    step = db.trials()[0].options["workload"]["step_bytes"]
    assert step == json.loads(inspect_model(model, as_json=True))["decode_weight_bytes_per_token"] + kv_read(model, 256)
    assert all(r.options["workload"]["step_bytes"] == step for r in db.trials())
    # and the records say so: one-token kernels rotated through copies until a pass reads the step's bytes
    reuse = reuse_bytes(Workload(step_bytes=step), last_level_cache())
    timed = [r for r in db.trials() if r.status == "ok"]
    assert timed and all(r.stats["method"] == "rotate" and r.stats["reuse"] == reuse for r in timed)
    gemv = select_rule(matmul_request(QuantType.Q4_K, 64, 256, m=1, layout="tile16", act_bits=16), PRESET).name
    assert {r.rule for r in records} >= {gemv, "attention_input", "attention_decode"}
    assert all(r.seconds > 0 for r in records)
    # each kernel's candidate was re-timed with its default in alternation; compile applies it only if it won
    # every round, and reports the others as slower than their defaults
    confirmed = [r for r in records if r.confirmed]
    assert confirmed and all(r.stats["rounds"] == CONFIRM_ROUNDS for r in confirmed)
    assert all(r.confirmed or r.trial == 0 for r in records)  # unconfirmed: a one-point space
    applied = [r for r in records if r.beats_default()]
    assert all(r.stats["wins"] == CONFIRM_ROUNDS for r in applied if r.confirmed)
    report = compile_model(model, tmp_path / "art", replace(SOURCE, target=target, tuning_db=tmp_path / "tune.jsonl"))
    art = report.path
    (line,) = report.tuning  # every tuned kernel found, measured on this CPU with these threads
    assert f"{len(applied)} kernels tuned ({len(applied)} measured on this CPU model with 2 threads" in line
    if len(applied) < len(records):
        assert f"{len(records) - len(applied)} whose record was slower than the default" in line
    manifest = json.loads((art / "manifest.json").read_text())
    for k in manifest["targets"][0]["kernels"]:
        rec = db.best(target, k["name"], k["rule"])
        if rec is not None and rec.beats_default():
            assert k["knobs"] == rec.knobs


def kv_read(model, ctx: int) -> int:
    """Bytes of KV a decode step of the model reads at `ctx` (every block: `ellm inspect`'s bytes per token,
    the pinned first block at float16)."""
    from kvcache import pinned_extra

    per_token = json.loads(inspect_model(model, as_json=True))["kv_bytes_per_token"]
    return int(per_token * ctx) + pinned_extra(model, per_token)
