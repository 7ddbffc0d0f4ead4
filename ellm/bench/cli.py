"""`ellm bench`: decode and prefill speed against the measured memory bandwidth (optionally against
llama.cpp), or with --spec, speculative decoding on the task set."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..cli import (_nonneg_int, _positive_int, add_attention_args, add_rope_scaling_args, attention_overrides,
                   rope_scaling_option)
from ..errors import EllmError
from ..numa.topology import default_threads


def add_parser(sub) -> None:
    b = sub.add_parser("bench", help="decode/prefill speed vs measured memory bandwidth, optionally vs llama.cpp")
    b.add_argument("artifact", nargs="?", help="artifact directory (default: the bundled model, compiled and cached)")
    b.add_argument("--model", help="the GGUF the artifact was compiled from (for llama.cpp; default: the bundled model)")
    b.add_argument("--ctx", default=None,
                   help="comma-separated context lengths (default 512,2048,8000; with --spec, prompt lengths 2048,8000)")
    b.add_argument("--gen", type=_positive_int, default=None,
                   help="timed decode steps per repeat (default 64; with --spec, most tokens generated per task, 256)")
    b.add_argument("--spec", action="store_true",
                   help="speculative decoding on the task set (input-grounded and open-ended tasks): decode tokens/s "
                        "without and with speculation, and llama.cpp's prompt lookup with --vs llama.cpp")
    b.add_argument("--chain", type=_positive_int, default=16, help="with --spec: the longest chain (default 16)")
    b.add_argument("--tasks", help="with --spec: comma-separated task names (default: all)")
    b.add_argument("--draft", default="ngram",
                   help="with --spec: comma-separated drafters to run, each against the same plain runs (ngram, model, "
                        "cascade; default ngram)")
    b.add_argument("--draft-model", metavar="DIR|GGUF", help="with --spec: the draft model of --draft model/cascade")
    b.add_argument("--warmup", type=_nonneg_int, default=4, help="untimed decode steps per repeat")
    b.add_argument("--repeat", type=_positive_int, default=3)
    b.add_argument("--rounds", type=_positive_int, default=2, help="alternating rounds of the systems")
    b.add_argument("--threads", type=_positive_int, default=None)
    b.add_argument("--vs", metavar="llama.cpp", help="also run llama.cpp on the same GGUF (built on demand)")
    b.add_argument("--compare", metavar="ARTIFACT[,ARTIFACT]",
                   help="more eLLM artifacts of the same model (a tuned build, say), alternated with the first")
    b.add_argument("--target", help="eLLM: run this target of the artifact (default: the best this CPU runs)")
    b.add_argument("--llama-build", default="native",
                   help="llama.cpp builds, comma-separated: native (GGML_NATIVE), avx512 (AVX-512 VNNI, AMX off), "
                        "avx2 (AVX-512 off) (default native)")
    b.add_argument("--llama-kv", default="f16", help="llama.cpp KV cache types, comma-separated: f16, q8_0 (default f16)")
    b.add_argument("--llama-fa", default="on", help="llama.cpp flash attention: on, off or on,off (default on)")
    b.add_argument("--json", action="store_true")
    b.add_argument("--plot", metavar="FILE.png", help="draw decode tokens/s against context length")
    add_rope_scaling_args(b)
    add_attention_args(b)
    b.set_defaults(func=cmd_bench)


def cmd_bench(a: argparse.Namespace) -> int:
    from .runner import BenchConfig, format_table, llama_configs, run_bench
    from ..demo import cached_artifact
    from ..models import resolve_model
    from ..runtime.artifact import Artifact

    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    # every option checked before the default artifact is compiled (minutes) or opened
    ctxs = _ints(a.ctx or ("2048,8000" if a.spec else "512,2048,8000"), "--ctx")
    vs = a.vs.lower() if a.vs else None
    if vs not in (None, "llama.cpp"):
        raise EllmError(f"--vs supports llama.cpp, not {a.vs!r}")
    split = lambda s: [x.strip() for x in s.split(",") if x.strip()]  # noqa: E731
    flash = [{"on": True, "off": False}[f] if f in ("on", "off") else _bad_flash(f) for f in split(a.llama_fa)]
    llama = llama_configs(split(a.llama_build), split(a.llama_kv), flash) if vs else ()
    artifact = Path(a.artifact) if a.artifact else cached_artifact(log=log)
    model = Path(a.model) if a.model else resolve_model(None)
    if a.artifact and not a.model:
        source = Artifact.open(artifact, verify=False).manifest["source"]["file"]
        if source != model.name:
            if vs:
                raise EllmError(f"the artifact was compiled from {source}; pass --model with that GGUF for llama.cpp")
            model = Path(source)  # only eLLM runs: the GGUF itself is not read, its name labels the report
    if a.spec:
        return _bench_spec(a, artifact, model, ctxs, llama, log)
    cfg = BenchConfig(
        artifact=artifact, model=model, ctxs=ctxs, gen=a.gen or 64, warmup=a.warmup,
        repeat=a.repeat, rounds=a.rounds, threads=a.threads or default_threads(), llama=llama, target=a.target,
        attention=attention_overrides(a), rope_scaling=rope_scaling_option(a),
        others=tuple(Path(p) for p in split(a.compare or "")),
    )
    report = run_bench(cfg, log=log)
    if a.plot:
        from .plot import plot_report

        plot_report(report, a.plot)
        log(f"wrote {a.plot}")
    print(json.dumps(report, indent=1) if a.json else format_table(report))
    return 0


def _ints(text: str, flag: str) -> tuple[int, ...]:
    try:
        values = tuple(int(c) for c in text.split(",") if c.strip())
    except ValueError:
        values = ()
    if not values or min(values) < 1:
        raise EllmError(f"{flag} takes comma-separated positive integers, got {text!r}")
    return values


def _bench_spec(a: argparse.Namespace, artifact: Path, model: Path, ctxs: tuple[int, ...], llama, log) -> int:
    from .spec import SpecBenchConfig, format_spec_table, run_spec_bench
    from .spec_tasks import TASKS

    if len(llama) > 1:
        raise EllmError("--spec compares one llama.cpp configuration: give one --llama-build, --llama-kv and --llama-fa")
    if a.tasks:
        unknown = set(a.tasks.split(",")) - {t.name for t in TASKS}
        if unknown:
            raise EllmError(f"unknown task(s) {', '.join(sorted(unknown))} (tasks: {', '.join(t.name for t in TASKS)})")
    lc = llama[0] if llama else None
    cfg = SpecBenchConfig(
        artifact=artifact, model=model, ctxs=ctxs, gen=a.gen or 256, chain=a.chain,
        drafters=tuple(d.strip() for d in a.draft.split(",") if d.strip()),
        draft_model=Path(a.draft_model) if a.draft_model else None,
        rounds=a.rounds, threads=a.threads or default_threads(), tasks=a.tasks,
        llama_build=lc.build if lc else None, llama_kv=lc.kv_type if lc else "f16", llama_flash=lc.flash_attn if lc else True)
    report = run_spec_bench(cfg, log=log)
    print(json.dumps(report, indent=1) if a.json else format_spec_table(report))
    return 0


def _bad_flash(f: str):
    raise EllmError(f"--llama-fa takes on, off or both (on,off), not {f!r}")
