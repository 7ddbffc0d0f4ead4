"""The tuning database: lookups by CPU model and thread count with a fallback to the target preset, never a
record slower than the default, round trips, merges, and compile reporting what it found."""

from __future__ import annotations

from kernels import PRESET, matmul_request, select_rule
from synthetic import write_model

from ellm.autotune import TuningDatabase, TuningRecord
from ellm.autotune.tuner import TuneOptions, Workload, tune_model
from ellm.compiler.build import CompileOptions, compile_model
from ellm.quant import QuantType

REQ = matmul_request(QuantType.Q4_1, 256, 512, m=1)  # the float GEMV: rule "gemv", knob rows_per_task
RULE = select_rule(REQ, PRESET).name


def _rec(cpu, threads, rows, seconds, default_seconds=4e-5, kernel=None):
    return TuningRecord("znver4", cpu, kernel or REQ.key(), "gemv", {"rows_per_task": rows}, seconds, threads,
                        default_seconds=default_seconds)


def _db(tmp_path):
    db = TuningDatabase(tmp_path / "db.jsonl")
    db.add(_rec("cpu A", 2, 16, 2e-5))
    db.add(_rec("cpu A", 1, 4, 3e-5))
    db.add(_rec("cpu B", 2, 32, 1e-5, default_seconds=1.1e-5))  # faster, but a smaller gain over its default
    return db


def test_lookup_prefers_the_same_cpu_and_threads(tmp_path):
    db = _db(tmp_path)
    assert RULE == "gemv"
    look = db.lookup_for("znver4", "cpu A", 2)
    assert look(REQ, "gemv") == {"rows_per_task": 16} and look.hits == {REQ.key(): "cpu"}
    assert db.lookup_for("znver4", "cpu A", 1)(REQ, "gemv") == {"rows_per_task": 4}
    other = db.lookup_for("znver4", "cpu C", 2)  # not measured there: the preset's best gain over default
    assert other(REQ, "gemv") == {"rows_per_task": 16} and other.hits == {REQ.key(): "target"}
    none = db.lookup_for("znver5", "cpu A", 2)
    assert none(REQ, "gemv") is None and none.misses == {REQ.key()}
    assert "1 not in it" in none.summary() and REQ.key() in none.summary()


def test_a_record_slower_than_the_default_is_never_applied(tmp_path):
    db = TuningDatabase(tmp_path / "db.jsonl")
    db.add(_rec("cpu A", 2, 16, 5e-5, default_seconds=4e-5))
    look = db.lookup_for("znver4", "cpu A", 2)
    assert look(REQ, "gemv") is None and look.slower == {REQ.key()}
    assert "slower than the default" in look.summary()


def test_round_trip_and_merge(tmp_path):
    db = _db(tmp_path)
    db.add(TuningRecord("znver4", "cpu A", REQ.key(), "gemv", {"rows_per_task": 64}, 0.0, 2, status="build_error",
                        message="no"))
    db.save()
    again = TuningDatabase.open(tmp_path / "db.jsonl")
    assert again.records() == db.records() and again.failures() == db.failures()
    fleet = TuningDatabase(tmp_path / "fleet.jsonl", [_rec("cpu A", 2, 8, 1.5e-5), _rec("cpu D", 2, 1, 3e-5)])
    fleet.merge(again)
    assert fleet.best("znver4", REQ.key(), "gemv", "cpu A", 2).knobs == {"rows_per_task": 8}  # the faster one
    assert len(fleet.records()) == 4 and len(fleet.failures()) == 1


def test_compile_reports_misses_for_a_database_of_other_options(tmp_path):
    """Tuned with the default KV cache, compiled with a q8 one: the attention kernels are other kernels, and
    compile says so instead of silently keeping defaults."""
    model = write_model(tmp_path / "m.gguf", n_layers=1)
    db = tune_model(model, tmp_path / "tune.jsonl", target=PRESET.name, threads=2, options=TuneOptions("random", trials=1, workers=0),
                    workload=Workload(tokens=16, ctx=256), kernels=r"^attention_m1_")
    (rec,) = db.records()
    report = compile_model(model, tmp_path / "art", CompileOptions(target=PRESET.name, cache_type_k="q8", cache_type_v="q8",
                                                                     tuning_db=tmp_path / "tune.jsonl"))
    (line,) = report.tuning
    assert "0 kernels tuned" in line and rec.kernel not in line
    assert "not in it" in line and "attention_m1_" in line


def test_trials_append_as_json_lines_and_a_torn_line_is_skipped(tmp_path):
    """Every trial is one line appended at once; a crash mid-append leaves a torn line that reading skips
    and the next append does not run into; a file of other JSON, or of the old format, is an error that
    says so."""
    import json

    import pytest

    from ellm.errors import EllmError

    path = tmp_path / "db.jsonl"
    db = TuningDatabase(path)
    for i, rows in enumerate((8, 16, 4)):
        db.append(_rec("cpu A", 2, rows, (3 - i) * 1e-5))
    lines = path.read_text().splitlines()
    assert len(lines) == 4 and json.loads(lines[0])["format"] == "ellm-tuning-db"
    assert [json.loads(x)["knobs"]["rows_per_task"] for x in lines[1:]] == [8, 16, 4]
    with open(path, "a") as f:
        f.write('{"target": "znver4", "cpu": "cpu A", "kern')  # torn
    again = TuningDatabase.open(path)
    assert len(again.trials()) == 3 and again.best("znver4", REQ.key(), "gemv", "cpu A", 2).knobs == {"rows_per_task": 4}
    db2 = TuningDatabase(path)  # the next append starts a fresh line after the torn one
    db2.append(_rec("cpu A", 2, 32, 0.5e-5))
    again = TuningDatabase.open(path)
    assert again.skipped == 1 and len(again.trials()) == 4
    assert again.best("znver4", REQ.key(), "gemv", "cpu A", 2).knobs == {"rows_per_task": 32}
    path.write_text(lines[0] + "\n" + json.dumps({"some": "thing"}) + "\n")
    with pytest.raises(EllmError, match="not a tuning record"):
        TuningDatabase.open(path)
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"format": "ellm-tuning-db", "version": 1, "records": []}))
    with pytest.raises(EllmError, match="not an eLLM tuning database|version 1"):
        TuningDatabase.open(old)


def test_two_processes_append_to_one_database(tmp_path):
    """A fleet's runs may share a file: concurrent appends from two processes lose no record."""
    import subprocess
    import sys

    path = tmp_path / "db.jsonl"
    code = ("import sys; from ellm.autotune import TuningDatabase, TuningRecord\n"
            "db = TuningDatabase(sys.argv[1])\n"
            "for i in range(200): db.append(TuningRecord('znver4', sys.argv[2], 'k', 'gemv', {'rows_per_task': i}, 1e-5 + i * 1e-9, 2))\n")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(path), cpu]) for cpu in ("cpu A", "cpu B")]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    db = TuningDatabase.open(path)
    assert sorted(r.cpu for r in db.trials()).count("cpu A") == 200 and len(db.trials()) == 400


def test_merge_keeps_identical_records_once(tmp_path):
    a = _db(tmp_path)
    b = TuningDatabase(None, a.trials() + a.trials()[:1])
    a.merge(b)
    assert len(a.trials()) == 3
    c = TuningDatabase(None)
    c.merge(b)
    assert len(c.trials()) == 3


def test_a_record_with_knobs_the_rule_no_longer_takes_is_stale(tmp_path):
    db = TuningDatabase(tmp_path / "db.jsonl")
    db.add(_rec("cpu A", 2, 16, 2e-5))
    db.add(TuningRecord("znver4", "cpu A", REQ.key(), "gemv", {"tile_q": 3}, 1e-5, 2, default_seconds=4e-5))
    look = db.lookup_for("znver4", "cpu A", 2)
    assert look(REQ, "gemv") is None and look.stale == {REQ.key()}
    assert "knobs this version does not take" in look.summary()


def test_a_stale_record_of_this_cpu_falls_back_to_the_preset(tmp_path):
    db = TuningDatabase(tmp_path / "db.jsonl")
    db.add(TuningRecord("znver4", "cpu A", REQ.key(), "gemv", {"tile_q": 3}, 1e-5, 2, default_seconds=4e-5))
    db.add(_rec("cpu B", 2, 32, 2e-5))
    look = db.lookup_for("znver4", "cpu A", 2)
    assert look(REQ, "gemv") == {"rows_per_task": 32} and look.hits == {REQ.key(): "target"} and not look.stale
