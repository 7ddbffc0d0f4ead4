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
from kernels import PRESET, asm, candidates
from synthetic import write_model
from test_schedule_knobs import REQUESTS

from ellm.autotune import TuningDatabase
from ellm.autotune.tuner import TuneOptions, Workload, tune_model
from ellm.compiler.build import CompileOptions
from ellm.schedules import RULES, rule_by_name, select_rule


def _decode(name):
    req, preset = REQUESTS[name]
    return dataclasses.replace(req, m=1), preset


def _asm(rule, req, preset, knobs) -> str:
    func = rule.build_kernel(req, preset, knobs)
    return asm(func.with_attr("global_symbol", "k"), preset)


@pytest.mark.parametrize("name", ["attention_input", "int_ffn"])
def test_one_token_candidates_are_distinct_kernels(name):
    """`tokens_per_tile` does nothing for one token: the tuner must not time it as nine configurations."""
    req, preset = _decode(name)
    rule = select_rule(req, preset)
    assert rule.name == name
    assert "tokens_per_tile" not in {k.name for k in rule.space(req, preset).knobs}
    points = candidates(rule, req, preset, budget=6)
    assert len(points) == 6
    codes = [_asm(rule, req, preset, p) for p in points]
    assert len(set(codes)) == len(codes)


def test_moot_knobs_make_one_point():
    """prefetch_bytes=0 with any prefetch kind is one kernel, and so is one row tile per task, adjacent or
    spread: the space holds one point for each, and the kernels they stand for are indeed the same."""
    req, preset = REQUESTS["avx2_gemv"]
    rule = select_rule(req, preset)
    space = rule.space(req, preset)
    rest = lambda p, *drop: tuple(v for k, v in sorted(p.items()) if k not in drop)  # noqa: E731
    no_pf = [p for p in space.points() if p["prefetch_bytes"] == 0]
    assert no_pf and len(no_pf) == len({rest(p, "prefetch_locality") for p in no_pf})
    one = [p for p in space.points() if p["tiles_per_task"] == 1]
    assert one and len(one) == len({rest(p, "strided_tiles") for p in one})
    base = space.default
    same = [{**base, "prefetch_bytes": 0, "prefetch_locality": 0}, {**base, "prefetch_bytes": 0, "prefetch_locality": 3}]
    assert _asm(rule, req, preset, same[0]) == _asm(rule, req, preset, same[1])
    assert _asm(rule, req, preset, {**base, "tiles_per_task": 1, "strided_tiles": 0}) == \
        _asm(rule, req, preset, {**base, "tiles_per_task": 1, "strided_tiles": 1})


def _disassembly(path) -> str:
    import subprocess

    return subprocess.run(["objdump", "-d", "--no-show-raw-insn", str(path)], capture_output=True, text=True, check=True).stdout


def test_tuner_times_the_kernel_compile_ships(tmp_path):
    """The prefetch knob must change what is timed: the library a candidate is timed from carries the
    injected prefetches (and none without them)."""
    from ellm.autotune.builder import BuildJob, build_one

    req, preset = REQUESTS["avx2_gemv"]
    rule = select_rule(req, preset)
    libs = {}
    for pf in (0, 4096):
        knobs = rule.resolve_knobs(req, preset, {"prefetch_bytes": pf, "prefetch_locality": 0})
        built = build_one(BuildJob(rule.name, req, preset.name, knobs), str(tmp_path))
        assert built.status == "ok", built.message
        libs[pf] = _disassembly(built.path)
    assert "prefetchnta" not in libs[0]
    assert "prefetchnta" in libs[4096]


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
        if knobs != rule.default_knobs(req, target):
            raise RuntimeError("a schedule the target cannot take")
        return real(self, req, target, knobs)

    monkeypatch.setattr(type(rule), "build", build)
    db = tune_model(model, tmp_path / "db.jsonl", target=PRESET.name, threads=2, workload=Workload(tokens=16, ctx=256),
                    kernels=r"^attention_m1_", options=TuneOptions("random", trials=3, workers=0))
    fails = db.failures()
    assert len(fails) == 2 and all(f.status == "build_error" and "cannot take" in f.message for f in fails)
    (best,) = db.records()  # the default, the one candidate that built
    assert best.rule == "attention_decode" and best.status == "ok" and best.seconds > 0 and best.trial == 0
    assert all(f.knobs != best.knobs for f in fails)
    again = TuningDatabase.open(tmp_path / "db.jsonl")
    assert len(again.failures()) == 2 and len(again.records()) == 1 and len(again.trials()) == 3


def test_a_candidate_with_wrong_results_is_recorded_and_skipped(tmp_path, monkeypatch):
    """A point whose kernel computes something else (here: 8-bit activations for a 16-bit request) is
    caught by the check against the default before it is timed, and never becomes the best."""
    import dataclasses as dc

    model = write_model(tmp_path / "m.gguf", n_layers=1)
    rule = next(r for r in RULES if r.name.endswith("_gemv") and r.isa_applies(PRESET))
    real = type(rule).build

    def build(self, req, target, knobs):
        if knobs != self.default_knobs(req, target):
            req = dc.replace(req, attrs=tuple((k, 8 if k == "act_bits" else v) for k, v in req.attrs))
        return real(self, req, target, knobs)

    monkeypatch.setattr(type(rule), "build", build)
    db = tune_model(model, tmp_path / "db.jsonl", target=PRESET.name, threads=2, kernels=r"^matmul_.*_m1_",
                    options=TuneOptions("random", trials=3, workers=0), compile_options=CompileOptions(activations="int16"))
    wrong = [r for r in db.trials() if r.status == "wrong"]
    assert wrong and all("differs from the default" in r.message for r in wrong)
    assert all(r.trial == 0 for r in db.records())


def test_space_of_every_rule_is_within_its_knobs():
    for name, (req, preset) in REQUESTS.items():
        rule = select_rule(req, preset)
        assert {k.name for k in rule.space(req, preset).knobs} <= {k.name for k in rule.knobs}
