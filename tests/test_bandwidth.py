"""The bandwidth bound of `ellm bench`: a buffer that misses the last-level cache, and a kernel that reads all of it."""

from __future__ import annotations

import pytest

from ellm.bench.bandwidth import buffer_mb, measure_read_bandwidth


@pytest.mark.parametrize(
    "llc, mb", [(0, 512), (32 << 20, 512), (300 << 20, 1200), (480 << 20, 1920), ((480 << 20) + 1, 1924)]
)
def test_buffer_is_four_times_the_llc(llc, mb):
    assert buffer_mb(llc) == mb


def test_read_kernel_reads_the_whole_buffer():
    # measure_read_bandwidth checks the kernel's sum of ones against the element count
    bw = measure_read_bandwidth(threads=2, size_mb=8, repeats=2)
    assert bw.bytes == 8 << 20
    assert 0 < bw.gb_s_min <= bw.gb_s_median <= bw.gb_s_max
    assert bw.prefetch_bytes in (0, 2048, 8192)


def test_bench_report_brackets_each_run_and_names_the_host(artifact, model_path):
    """`ellm bench` end to end (eLLM alone, one tiny round): every run carries the bandwidth measured before and
    after it, is set against the higher, and the report says which machine it came from."""
    from ellm.bench.runner import BenchConfig, run_bench
    from ellm.targets import detect_host

    report = run_bench(BenchConfig(artifact, model_path, ctxs=(64,), gen=2, warmup=1, repeat=1, rounds=1, threads=2))
    assert report["host"] == detect_host().record()
    (row,) = report["rows"]
    assert row["system"] == "ellm" and row["ctx"] == 64 and row["decode_tok_s"] > 0
    (bw,) = row["bandwidth_gb_s_per_run"]
    ((before, after),) = row["bandwidth_gb_s_around_per_run"]
    assert 0 < min(before, after) <= bw == max(before, after)
    assert abs(row["pct_of_bandwidth"] - 100 * row["decode_tok_s"] * row["bytes_per_token"] / 1e9 / bw) < 1e-6


def test_bench_alternates_compared_artifacts_and_reports_their_ratio(artifact, model_path, tmp_path):
    """`ellm bench --compare`: a second artifact of the same model runs in the same rounds and the report
    gives its decode ratio against the first."""
    from ellm.bench.runner import BenchConfig, run_bench

    other = tmp_path / "tuned"
    other.symlink_to(artifact, target_is_directory=True)
    report = run_bench(BenchConfig(artifact, model_path, ctxs=(64,), gen=2, warmup=1, repeat=1, rounds=1, threads=2,
                                   others=(other,)))
    assert [r["system"] for r in report["rows"]] == ["ellm", "ellm[tuned]"]
    (q,) = report["artifact_ratios"]
    rates = {r["system"]: r["decode_tok_s"] for r in report["rows"]}
    assert q["system"] == "ellm[tuned]" and abs(q["decode_ratio"] - rates["ellm[tuned]"] / rates["ellm"]) < 1e-9


def test_bench_of_another_models_artifact_needs_its_gguf_only_for_llama_cpp(tmp_path, monkeypatch, capsys):
    """An artifact compiled from another GGUF benches without --model (the report names its source); only
    --vs llama.cpp, which runs that GGUF, asks for it."""
    import json

    from ellm import cli
    from ellm.bench import runner
    from ellm.runtime.artifact import Artifact

    class Other:
        manifest = {"source": {"file": "llama-1b.gguf"}}

    seen = []
    monkeypatch.setattr(Artifact, "open", classmethod(lambda cls, path, verify=True: Other()))
    monkeypatch.setattr(runner, "run_bench", lambda cfg, log=None: seen.append(cfg) or {"model": cfg.model.name})
    assert cli.main(["bench", str(tmp_path), "--json"]) == 0
    (cfg,) = seen
    assert cfg.model.name == "llama-1b.gguf" and json.loads(capsys.readouterr().out) == {"model": "llama-1b.gguf"}
    assert cli.main(["bench", str(tmp_path), "--vs", "llama.cpp"]) == 2
    assert "pass --model with that GGUF for llama.cpp" in capsys.readouterr().err and len(seen) == 1
