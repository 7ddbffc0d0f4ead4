"""`ellm tune` and `ellm tune report` from the command line: a short real tune of a synthetic model, its JSON
summary, and the report's table, curves and trials-to-95%."""

from __future__ import annotations

import json

from kernels import PRESET
from synthetic import write_model

from ellm.autotune import TuningDatabase, TuningRecord
from ellm.autotune.report import build_report, curve, trials_to
from ellm.cli import main


def _trials(seconds, strategy="random", default=None):
    default = default or seconds[0]
    return [TuningRecord("znver4", "cpu A", "k", "gemv", {"rows_per_task": i}, s, 2, status="ok" if s else "build_error",
                         default_seconds=default, strategy=strategy, trial=i, elapsed_s=0.5 * i,
                         stats={"bytes": 1e6}, options={"bandwidth_gbs": 40.0})
            for i, s in enumerate(seconds)]


def test_curves_and_trials_to_95_percent():
    t = _trials([10e-6, 0, 9e-6, 12e-6, 5e-6, 5.1e-6])
    c = curve(t)
    assert [p["best_s"] for p in c] == [10e-6, 10e-6, 9e-6, 9e-6, 5e-6, 5e-6]
    assert c[-1]["speedup"] == 2.0 and trials_to(t) == 5
    rep = build_report(TuningDatabase(None, t + _trials([10e-6, 6e-6], "model")))
    (k,) = rep["kernels"]
    assert k["best_s"] == 5e-6 and k["speedup"] == 2.0 and abs(k["gbs"] - 200.0) < 1e-9 and abs(k["pct_bandwidth"] - 500) < 1e-9
    assert k["strategies"]["random"]["failed"] == 1 and k["strategies"]["model"]["trials_to_95"] == 2


def test_tune_then_report_on_the_command_line(tmp_path, capsys):
    model = write_model(tmp_path / "m.gguf", n_layers=1)
    db = tmp_path / "db.jsonl"
    rc = main(["tune", str(model), "-o", str(db), "--target", PRESET.name, "--strategy", "evolutionary", "--trials", "3",
               "--batch", "3", "--workers", "2", "--kernels", "^attention_input_.*_m1_", "--ctx", "256", "--json"])
    assert rc == 0
    (summary,) = json.loads(capsys.readouterr().out)
    recs = TuningDatabase.open(db).trials()
    search = [r for r in recs if not r.confirmed]
    again = [r for r in recs if r.confirmed]  # the 2 candidates, re-timed with the default
    assert [r.trial for r in search] == [0, 1, 2] and all(r.strategy == "evolutionary" for r in recs)
    assert 1 <= len(again) <= 2 and [r.trial for r in again] == list(range(3, 3 + len(again)))
    assert summary["trials"] == len(recs) and summary["confirmed"]
    assert summary["applied"] == (summary["gain"] >= 1.0 and max(r.stats["wins"] for r in again) == 5)
    r = recs[0]
    assert r.versions["ellm"] and r.versions["tvm"] and r.cpu_features and r.options["bandwidth_gbs"] > 0
    assert r.stats["bytes"] > 0 and r.stats["passes"] == 3 and r.options["compile"]["target"] == PRESET.name
    assert main(["tune", "report", str(db)]) == 0
    out = capsys.readouterr().out
    assert "attention_input" in out and "evolutionary" in out and "confirmed" in out
    assert main(["tune", "report", str(db), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert rep["kernels"][0]["strategies"]["evolutionary"]["trials"] == 3  # the search's own trials
    assert rep["kernels"][0]["confirmed"]["applied"] == summary["applied"]


def test_report_of_a_missing_database_is_an_error(tmp_path, capsys):
    assert main(["tune", "report", str(tmp_path / "none.jsonl")]) == 2
    assert "no tuning database" in capsys.readouterr().err
