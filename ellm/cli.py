"""The `ellm` command line: compile, run, inspect, tune, bench, demo, targets, eval, synth."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from .errors import EllmError
from .numa.cli import add_numa_args, numa_option


def _regex(text: str) -> str:
    try:
        re.compile(text)
    except re.error as e:
        raise argparse.ArgumentTypeError(f"not a regular expression: {e}") from None
    return text


def _positive_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {s!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {v}")
    return v


def _thread_counts(s: str) -> tuple[int, ...]:
    return tuple(_positive_int(p) for p in s.split(","))


def _nonneg_int(s: str) -> int:
    v = int(s)
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {v}")
    return v


def add_kv_type_args(p: argparse.ArgumentParser) -> None:
    from .kv.plan import KV_TYPE_CHOICES

    names = list(KV_TYPE_CHOICES)
    p.add_argument("--kv-type", choices=names, default="auto",
                   help="KV cache type of K and V (default auto: per layer from the measured precision plan; with "
                        "--precision source, q4 with q8 keys in the first layers, within 30%% of f16)")
    p.add_argument("--cache-type-k", choices=names, help="K cache type (overrides --kv-type)")
    p.add_argument("--cache-type-v", choices=names, help="V cache type (overrides --kv-type)")
    p.add_argument("--kv-store", choices=("protected", "plain"), default="protected",
                   help="protected (default): quantised keys stored in each head's Hadamard basis and the first block "
                        "(the attention sinks) kept at float16; plain: neither")


def kv_types(a: argparse.Namespace) -> tuple[str, str]:
    return a.cache_type_k or a.kv_type, a.cache_type_v or a.kv_type


def compile_options(a: argparse.Namespace, target: str | None = None):
    """CompileOptions from the options add_compile_option_args adds (compile, and tune: kernel keys must match)."""
    from .compiler.build import CompileOptions

    return CompileOptions(
        target=target or a.target,
        cache_type_k=kv_types(a)[0],
        cache_type_v=kv_types(a)[1],
        kv_store=a.kv_store,
        disable_passes=tuple(a.disable_pass or ()),
        enable_passes=tuple(a.enable_pass or ()),
        tuning_db=Path(a.tuning_db) if getattr(a, "tuning_db", None) else None,
        max_chunk=a.max_chunk,
        activations=a.activations,
        prefetch=not a.no_prefetch,
        quant_level=a.quant_level,
        precision=a.precision,
        budget_mb=a.budget_mb,
        budget_ratio=a.budget_ratio,
        budget_ctx=a.budget_ctx,
        calibration=a.calibration,
        draft_layers=getattr(a, "draft_layers", None),
        numa_nodes=getattr(a, "numa_nodes", None),
        numa_threads=getattr(a, "numa_threads", None),
    )


def add_compile_option_args(c: argparse.ArgumentParser) -> None:
    """The options that change what compile builds (and so the kernels a tuning database must match)."""
    add_kv_type_args(c)
    c.add_argument("--disable-pass", action="append", metavar="PASS", help="skip a graph pass (repeatable)")
    c.add_argument("--enable-pass", action="append", metavar="PASS", help="run an opt-in graph pass, e.g. fuse_ffn")
    c.add_argument(
        "--activations", choices=["auto", "int16", "int8", "f32"], default="auto",
        help="matmul activations: int16/int8 integer kernels, f32 float kernels (auto, on AVX2 and later: int8 for prefill "
             "chunks and one-token steps; attention keeps 16-bit query and value rounding on 512-bit classes)",
    )
    c.add_argument("--quant-level", type=int, choices=[0, 1, 2], default=None,
                   help="0: everything at its highest precision (the GGUF's weights, f16 KV, int16 activations); 1: attention "
                        "weights and the head at 8 bits, KV q8, FFN at 4 bits; 2: everything at 4 bits. Never above a "
                        "weight's source type")
    from .precision.cli import add_precision_args

    add_precision_args(c)
    c.add_argument("--no-prefetch", action="store_true", help="compile without software prefetch")
    c.add_argument("--max-chunk", type=_positive_int, default=256, help="most tokens per prefill step (default 256)")
    c.add_argument("--numa-nodes", type=_positive_int, default=None, metavar="N",
                   help="plan the NUMA layout (weight rows and KV heads per node) for N nodes and record it in the "
                        "manifest; load uses it where N nodes are in use (default: planned at load)")
    c.add_argument("--numa-threads", type=_thread_counts, default=None, metavar="T[,T...]",
                   help="with --numa-nodes: threads per node the kernels split their work for, one count or one per "
                        "node; the kernels then run the plan's task -> thread map (default: this machine's physical "
                        "cores shared evenly)")
    c.add_argument("--draft-layers", type=_positive_int, default=None, metavar="L",
                   help="build a self-draft for speculative decoding (ellm run --draft model --draft-model DIR): the "
                        "model's first L layers and its head, at --quant-level 2 unless a recipe is given")


def cmd_compile(a: argparse.Namespace) -> int:
    from .compiler.build import compile_model

    options = compile_options(a)
    if a.tp is not None:
        from .parallel.cli import compile_group_cmd

        return compile_group_cmd(a, options)
    report = compile_model(a.model, a.output, options, force=a.force, log=lambda s: print(s, file=sys.stderr))
    print(
        f"wrote {report.path} ({report.artifact_bytes / 1e6:.1f} MB, {report.kernels} kernels, "
        f"target{'s' if len(report.targets) > 1 else ''} {', '.join(report.targets)}) in {report.seconds:.1f} s",
        file=sys.stderr,
    )
    return 0


def _read_prompt(a: argparse.Namespace) -> str:
    if a.prompt is not None:
        return a.prompt
    try:
        return Path(a.file).read_text(encoding="utf-8")
    except OSError as e:
        raise EllmError(f"cannot read prompt file {a.file}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise EllmError(f"prompt file {a.file} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                        "convert it first, e.g. iconv -f latin1 -t utf-8") from None


def prefill_progress():
    """A progress callback for long prompts: a status line on stderr (terminals only), after the first second."""
    import time

    start = time.perf_counter()

    def progress(done: int, total: int) -> None:
        if not sys.stderr.isatty() or time.perf_counter() - start < 1.0:
            return
        end = "\n" if done == total else ""
        print(f"\rprefill {done:,d}/{total:,d} tokens", end=end, file=sys.stderr, flush=True)

    return progress


def generate_and_report(eng, text: str, a: argparse.Namespace, load_s: float | None = None) -> int:
    """Tokenize (with the chat template if asked), generate, and print text or JSON."""
    from .runtime.sampling_cli import sampling_option, stops_option
    from .runtime.textstream import TextStream

    tok = eng.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": text}]) if a.chat else tok.encode(text)
    sampling, stream = sampling_option(a), TextStream(tok, stops_option(a))
    pieces: list[str] = []

    def on_token(t: int) -> bool:
        piece = stream.feed(t)
        pieces.append(piece)
        if piece and not a.json:
            sys.stdout.write(piece)
            sys.stdout.flush()
        return stream.stopped

    from .speculative.cli import speculative_option

    spec = speculative_option(a)
    if a.prompt_cache and Path(a.prompt_cache).exists():
        eng.load_session(a.prompt_cache)
    new = eng.generate(ids, a.n_predict, sampling=sampling, on_token=on_token, progress=prefill_progress(),
                       speculative=spec, cache_reuse=a.cache_reuse)
    pieces.append(stream.finish())
    if a.prompt_cache:
        eng.save_session(a.prompt_cache)
    st = eng.stats
    text_out = "".join(pieces)
    if a.json:
        print(
            json.dumps(
                {
                    "text": text_out,
                    "tokens": new,
                    "prompt_tokens": st.prompt_tokens,
                    "ttft_s": st.ttft_s,
                    "prefill_tok_s": st.prefill_tok_s,
                    "decode_tok_s": st.decode_tok_s,
                    "decode_tokens": st.decode_tokens,
                    "reused_tokens": st.reused_tokens,
                    "verify_steps": st.verify_steps,
                    "decode_steps": st.decode_steps,
                    "accept_rate": _finite(st.accept_rate),
                    "mean_accepted": _finite(st.mean_accepted),
                    "steps_saved": st.steps_saved,
                    "stop_reason": st.stop_reason,
                    "threads": eng.threads,
                    "ctx_size": eng.ctx_size,
                    "target": eng.target,
                    "load_s": load_s,
                    "max_rss_bytes": max_rss_bytes(),
                    "numa": eng.placement.summary(),
                }
            )
        )
    else:
        sys.stdout.write(pieces[-1] + "\n")
        spec = (f" ({st.verify_steps} chains: {100 * st.accept_rate:.0f}% of drafted tokens accepted, "
                f"{st.mean_accepted:.1f} a chain, {st.steps_saved} steps saved)" if st.verify_steps else "")
        decode = f"decode {st.decode_tokens} tokens: {st.decode_tok_s:.1f} tok/s" if st.decode_tokens else "no decode steps"
        print(
            f"[prompt {st.prompt_tokens} tokens: prefill {st.prefill_tok_s:.1f} tok/s, first token {st.ttft_s:.2f} s | "
            f"{decode}{spec} | stop: {st.stop_reason} | "
            f"{describe_target(eng.artifact)}]",
            file=sys.stderr,
        )
    return 0


def max_rss_bytes() -> int | None:
    """This process's peak resident memory (Linux reports kilobytes)."""
    try:
        import resource
    except ImportError:
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _finite(x: float) -> float | None:
    """JSON has no NaN: a statistic without samples is null."""
    return None if x != x else x


def cmd_run(a: argparse.Namespace) -> int:
    from .runtime.engine import Engine

    text = _read_prompt(a)
    from .parallel.build import is_group

    if is_group(a.artifact):
        from .parallel.cli import run_group

        return run_group(a, text)
    t = time.perf_counter()
    eng = Engine.load(a.artifact, threads=a.threads, ctx_size=a.ctx_size, target=a.target,
                      rope_scaling=rope_scaling_option(a), attention=attention_option(a, a.artifact),
                      numa=numa_option(a))
    return generate_and_report(eng, text, a, load_s=time.perf_counter() - t)


def describe_target(art) -> str:
    """One line: which of the artifact's targets runs here."""
    t = art.target
    others = [n for n in art.target_names if n != t["preset"]]
    rest = f" (artifact targets: {', '.join(art.target_names)})" if others else ""
    return f"target {t['preset']} ({t['isa'] or 'float'}){rest}"


def cmd_inspect(a: argparse.Namespace) -> int:
    from .compiler.inspect import inspect_model

    if a.precision:
        from .precision.cli import cmd_inspect_precision

        return cmd_inspect_precision(a)
    print(inspect_model(a.model, *kv_types(a), as_json=a.json, kv_store=a.kv_store))
    return 0


def cmd_demo(a: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(threads=a.threads, n_predict=a.n_predict, target=a.target)


def add_rope_scaling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rope-scaling", choices=["none", "linear", "yarn"], help="override the model's RoPE scaling")
    p.add_argument("--rope-scale", type=float, default=None, help="RoPE scaling factor (context multiplier)")


def rope_scaling_option(a: argparse.Namespace) -> tuple[str, float] | None:
    """(kind, factor) for Engine(rope_scaling=...), or None to keep the model's own."""
    if a.rope_scaling is None:
        if a.rope_scale is not None:
            raise EllmError("--rope-scale needs --rope-scaling linear|yarn")
        return None
    if a.rope_scaling == "none":
        return ("none", 1.0)
    if a.rope_scale is None or not a.rope_scale >= 1.0:
        raise EllmError(f"--rope-scaling {a.rope_scaling} needs --rope-scale F with F >= 1")
    return (a.rope_scaling, a.rope_scale)


def add_attention_args(p: argparse.ArgumentParser) -> None:
    from .kv.attention import AttentionConfig

    d = AttentionConfig()
    p.add_argument("--attention", choices=["sparse", "dense"], default=None,
                   help="block-sparse (sinks + window + top-K blocks) or exact dense attention (default sparse)")
    p.add_argument("--sinks", type=_nonneg_int, default=None, help=f"sink tokens, rounded up to whole blocks (default {d.sinks})")
    p.add_argument("--window", type=_positive_int, default=None, help=f"recent tokens always read (default {d.window})")
    p.add_argument("--topk", type=_nonneg_int, default=None,
                   help=f"remote blocks read, by score bound (default: the artifact's planned read budget, else {d.topk})")
    p.add_argument("--widen", type=_nonneg_int, default=None, help=f"most extra blocks dynamic widening may add (default {d.widen})")
    p.add_argument("--margin", type=float, default=None,
                   help=f"widen while the best unread bound is within this many nats of the best score read (default {d.margin:g})")


ATTENTION_FLAGS = (("mode", "attention"), ("sinks", "sinks"), ("window", "window"), ("topk", "topk"), ("widen", "widen"),
                   ("margin", "margin"))


def attention_overrides(a: argparse.Namespace) -> tuple[tuple[str, object], ...]:
    """The AttentionConfig fields the command line set ((field, value) pairs; the rest: the artifact's)."""
    return tuple((f, getattr(a, opt)) for f, opt in ATTENTION_FLAGS if getattr(a, opt, None) is not None)


def attention_option(a: argparse.Namespace, artifact) -> object:
    """The AttentionConfig to run `artifact` with: its planned one, with the command line's fields over it;
    None when the command line sets none (the engine then takes the artifact's)."""
    from .runtime.artifact import Artifact

    over = attention_overrides(a)
    if not over:
        return None
    return Artifact.open(artifact, verify=False, check_cpu=False).attention().with_overrides(over)


def attention_argv(over) -> list[str]:
    """The command-line options that recreate attention overrides (for worker processes)."""
    flag = dict(ATTENTION_FLAGS)
    return [x for f, v in over for x in (f"--{flag[f]}", repr(v) if isinstance(v, float) else str(v))]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ellm", description="Compile GGUF models to fast CPU inference artifacts and run them.")
    sub = p.add_subparsers(dest="command", required=True)

    c = sub.add_parser("compile", help="compile a GGUF model into an artifact directory")
    c.add_argument("model", nargs="?", help="GGUF file (default: the bundled SmolLM2-135M-Instruct Q4_1)")
    c.add_argument("-o", "--output", required=True, help="artifact directory to write")
    c.add_argument("--target", default="auto",
                   help="target preset, 'auto' (this CPU), or several separated by commas: one artifact for a fleet, "
                        "the best target a CPU can run chosen at load (see `ellm targets`)")
    add_compile_option_args(c)
    c.add_argument("--tuning-db", help="tuning database (JSON lines, from `ellm tune`) with schedule knobs")
    c.add_argument("--force", action="store_true", help="replace an existing output directory")
    from .parallel.cli import add_compile_args as add_parallel_compile_args

    add_parallel_compile_args(c)
    c.set_defaults(func=cmd_compile)

    r = sub.add_parser("run", help="generate text with a compiled artifact")
    r.add_argument("artifact", help="artifact directory")
    src = r.add_mutually_exclusive_group(required=True)
    src.add_argument("-p", "--prompt", help="prompt text")
    src.add_argument("-f", "--file", help="read the prompt from a file")
    r.add_argument("-n", "--n-predict", type=_nonneg_int, default=128, help="maximum new tokens (default 128)")
    r.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    r.add_argument("--threads", type=_positive_int, default=None, help="threads (default: the physical cores this process may use)")
    r.add_argument("--ctx-size", type=_positive_int, default=None, help="context size (default: the model's)")
    r.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    r.add_argument("--target", default=None, help="run this target of the artifact (default: the best this CPU can run)")
    add_rope_scaling_args(r)
    add_attention_args(r)
    add_numa_args(r)
    from .runtime.sampling_cli import add_sampling_args
    from .speculative.cli import add_speculative_args

    add_sampling_args(r)

    add_speculative_args(r)
    r.set_defaults(func=cmd_run)

    i = sub.add_parser("inspect", help="summarise a model's graph: ops, weight bytes per type, KV bytes per token")
    i.add_argument("model", nargs="?", help="GGUF file (default: the bundled model)")
    add_kv_type_args(i)
    i.add_argument("--precision", action="store_true",
                   help="the measured sensitivity per layer and part, the auto plan at the budget and its check")
    from .precision.cli import add_budget_args

    add_budget_args(i)
    i.add_argument("--plot", metavar="FILE.png", help="with --precision: the sensitivity heat map")
    i.add_argument("--json", action="store_true")
    i.set_defaults(func=cmd_inspect)

    from .targets.cli import add_parser as add_targets_parser

    add_targets_parser(sub)

    from .autotune.cli import add_parser as add_tune_parser

    add_tune_parser(sub)

    from .bench.cli import add_parser as add_bench_parser

    add_bench_parser(sub)

    d = sub.add_parser("demo", help="compile the bundled model (cached) and answer a question about a long document")
    d.add_argument("--threads", type=_positive_int, default=None)
    d.add_argument("-n", "--n-predict", type=_positive_int, default=96)
    d.add_argument("--target", default="auto")
    d.set_defaults(func=cmd_demo)

    from .serving.cli import add_parser as add_serve_parser

    add_serve_parser(sub)

    from .eval.cli import add_parser as add_eval_parser, cmd_eval
    from .synth.cli import add_parser as add_synth_parser

    add_eval_parser(sub)
    sub.choices["eval"].set_defaults(func=cmd_eval)
    add_synth_parser(sub)
    return p


def _quiet_finalizers() -> None:
    """After Ctrl-C, objects the interrupt cut in half (TVM's TempDirectory interrupted inside its
    __init__) fail in their __del__ as the traceback is freed; Python would print each as
    "Exception ignored in ...". The user asked to stop: one line, unless ELLM_DEBUG."""
    if not os.environ.get("ELLM_DEBUG"):
        sys.unraisablehook = lambda unraisable: None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["tune", "report"]:  # `ellm tune report DB`: the report, not a model named "report"
        argv = ["tune-report", *argv[2:]]
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except EllmError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        _quiet_finalizers()
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except Exception as e:  # a bug in eLLM, not a user error
        if os.environ.get("ELLM_DEBUG"):
            raise
        print(f"internal error: {type(e).__name__}: {e} (set ELLM_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
