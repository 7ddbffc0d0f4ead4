"""What the tuner searches and how it measures: regression tests for its defects (issue 11).

- every point it times is a distinct kernel (one-token requests ignore `tokens_per_tile`; with no
  prefetches, their kind is moot);
- it times kernels as compile ships them, prefetch injection included;
- knobs that change results are never searched on speed;
- a candidate that fails to build is recorded with its status and the run goes on.
Only assembly is compared where a kernel is not run, so any host can run these.
"""

from __future__ import annotations

import dataclasses

import pytest
from kernels import PRESET
from synthetic import write_model
from test_schedule_knobs import REQUESTS

import tvm
from ellm.autotune import TuningDatabase
from ellm.autotune import tuner
from ellm.autotune.tuner import Workload, candidates, search_knobs, tune_model
from ellm.schedules import RULES, rule_by_name, select_rule


def _decode(name):
    req, preset = REQUESTS[name]
    return dataclasses.replace(req, m=1), preset


def _asm(rule, req, preset, knobs) -> str:
    func = rule.build_kernel(req, preset, knobs)
    return tvm.compile(func.with_attr("global_symbol", "k"), target=preset.tvm_target()).mod.inspect_source("asm")


@pytest.mark.parametrize("name", ["attention_input", "int_ffn"])
def test_one_token_candidates_are_distinct_kernels(name):
    """`tokens_per_tile` does nothing for one token: the tuner must not time it as nine configurations."""
    req, preset = _decode(name)
    rule = select_rule(req, preset)
    assert rule.name == name
    assert "tokens_per_tile" not in {k.name for k in search_knobs(rule, req, preset)}
    points = candidates(rule, req, preset, budget=100)
    assert len(points) > 1
    codes = [_asm(rule, req, preset, p) for p in points]
    assert len(set(codes)) == len(codes)


def test_gemv_without_prefetch_has_one_candidate_per_kind():
    """prefetch_bytes=0 with either prefetch kind is one kernel: one candidate."""
    req, preset = REQUESTS["avx2_gemv"]
    rule = select_rule(req, preset)
    points = candidates(rule, req, preset, budget=100)
    no_pf = [p for p in points if p["prefetch_bytes"] == 0]
    assert len(no_pf) == len({p["tiles_per_task"] for p in no_pf})
    codes = [_asm(rule, req, preset, p) for p in points]
    assert len(set(codes)) == len(codes)


def test_tuner_times_the_kernel_compile_ships(monkeypatch):
    """The prefetch knob must change what is timed: the timed kernel carries the injected prefetches."""
    req, preset = REQUESTS["avx2_gemv"]
    rule = select_rule(req, preset)
    timed = []

    def fake_time(func, *args, **kw):
        timed.append(func)
        return 1e-5

    monkeypatch.setattr(tuner, "time_kernel", fake_time)
    for pf in (0, 4096):
        knobs = rule.resolve_knobs(req, preset, {"prefetch_bytes": pf, "prefetch_nta": 1})
        assert tuner.measure(rule, req, preset, knobs, Workload())[0] == "ok"
    asm0, asm4k = (tvm.compile(timed[i].with_attr("global_symbol", "k"), target=preset.tvm_target())
                   .mod.inspect_source("asm") for i in (0, 1))
    assert "prefetchnta" not in asm0
    assert "prefetchnta" in asm4k


def test_numerics_knobs_are_not_searched_on_speed():
    """int_scores, int_values and int_bits change the attention's results: candidates keep the defaults."""
    numeric = {(r.name, k.name) for r in RULES for k in r.knobs if k.numerics}
    assert {("attention_decode", "int_scores"), ("attention_decode", "int_values"), ("attention_decode", "int_bits"),
            ("attention", "int_bits")} <= numeric
    req, preset = REQUESTS["attention_decode"]
    rule = select_rule(req, preset)
    default = rule.default_knobs(req, preset)
    points = candidates(rule, req, preset, budget=100)
    assert len(points) > 1
    for p in points:
        assert all(p[k] == default[k] for k in ("int_scores", "int_values", "int_bits"))


def test_a_candidate_that_fails_to_build_does_not_end_the_run(tmp_path, monkeypatch):
    model = write_model(tmp_path / "m.gguf", n_layers=1)
    rule = rule_by_name("attention_decode")
    real = type(rule).build

    def build(self, req, target, knobs):
        if knobs["chunk"] != rule.default_knobs(req, target)["chunk"]:
            raise RuntimeError("a schedule the target cannot take")
        return real(self, req, target, knobs)

    monkeypatch.setattr(type(rule), "build", build)
    db = tune_model(model, tmp_path / "db.json", target=PRESET.name, budget=3, threads=2,
                    workload=Workload(tokens=16, ctx=256), kernels=r"^attention_m1_")
    fails = db.failures()
    assert len(fails) == 2 and all(f.status == "build_error" and "cannot take" in f.message for f in fails)
    (best,) = db.records()  # the default, the one candidate that built
    assert best.rule == "attention_decode" and best.status == "ok" and best.seconds > 0
    assert best.knobs["chunk"] not in {f.knobs["chunk"] for f in fails}
    again = TuningDatabase.open(tmp_path / "db.json")
    assert len(again.failures()) == 2 and len(again.records()) == 1


def test_space_of_every_rule_is_within_its_knobs():
    for name, (req, preset) in REQUESTS.items():
        rule = select_rule(req, preset)
        assert {k.name for k in rule.space(req, preset)} <= {k.name for k in rule.knobs}
