"""`ellm tune`: search schedule knobs for this CPU and append every trial to a tuning database."""

from __future__ import annotations

import argparse
import json
import sys

from ..cli import _positive_int, _regex, add_compile_option_args, compile_options

STRATEGY_NAMES = ("grid", "random", "evolutionary", "model")  # strategies.STRATEGIES (a test keeps them equal)
CONFIRM_TOP, CONFIRM_ROUNDS = 3, 5  # confirm.py's (the same test), here without importing TVM


def _seconds(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {s!r}") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {v}")
    return v


def add_parser(sub) -> None:
    tu = sub.add_parser("tune", help="search schedule knobs for this CPU; write a tuning database for `compile --tuning-db`")
    tu.add_argument("model", nargs="?", help="GGUF file (default: the bundled model)")
    tu.add_argument("-o", "--output", required=True, help="tuning database (JSON lines; trials are appended)")
    tu.add_argument("--target", default="auto", help="target preset the kernels are compiled for (default: this CPU's)")
    tu.add_argument("--strategy", choices=STRATEGY_NAMES, default="model",
                    help="grid, random, evolutionary, or model (XGBoost cost model) (default model)")
    tu.add_argument("--trials", type=_positive_int, default=64, help="trials per kernel, the default included (default 64)")
    tu.add_argument("--time-budget", type=_seconds, default=None, metavar="S", help="seconds of search per kernel")
    tu.add_argument("--patience", type=_positive_int, default=32, help="stop a kernel after this many trials without a 1%% gain")
    tu.add_argument("--batch", type=_positive_int, default=8, help="points built in parallel per round (default 8)")
    tu.add_argument("--workers", type=int, default=None, help="build processes (default: one per CPU; 0: none)")
    tu.add_argument("--confirm", type=int, default=CONFIRM_TOP, metavar="N",
                    help=f"re-time the N fastest points with the default, {CONFIRM_ROUNDS} rounds in alternation, "
                         f"and apply only what that confirms (default {CONFIRM_TOP}; 0: apply the search's fastest)")
    tu.add_argument("--seed", type=int, default=0)
    tu.add_argument("--threads", type=_positive_int, default=None, help="threads the kernels run with (default: the physical cores this process may use)")
    tu.add_argument("--tokens", type=_positive_int, default=256, help="prefill chunk the kernels are timed at")
    tu.add_argument("--ctx", type=_positive_int, default=4096,
                    help="context the attention kernels are timed at; one-token kernels reread their bytes after "
                         "what a decode step reads at it (default 4096)")
    tu.add_argument("--kernels", type=_regex, default=None, metavar="REGEX", help="tune only kernels whose name matches")
    tu.add_argument("--resume", action="store_true", help="continue the searches recorded in the database")
    tu.add_argument("--json", action="store_true", help="print a JSON summary per kernel")
    tu.add_argument("--rpc-tracker", metavar="HOST:PORT", help="measure on the servers of TVM's RPC tracker (built here)")
    tu.add_argument("--rpc-key", metavar="KEY", help="the servers' key (with --rpc-tracker)")
    tu.add_argument("--rpc-cpu", metavar="NAME", help="the servers' CPU model as records name it (default: KEY [llvm cpu])")
    add_compile_option_args(tu)
    tu.set_defaults(func=cmd_tune)
    add_report_parser(sub)


def cmd_tune(a: argparse.Namespace) -> int:
    from .measure import Workload
    from .tuner import TuneOptions, tune_model

    from ..errors import EllmError

    opts = TuneOptions(a.strategy, a.trials, a.time_budget, a.batch, a.patience, a.seed, a.workers, a.confirm)
    log = (lambda s: print(s, file=sys.stderr)) if a.json else print
    wl = Workload(tokens=a.tokens, ctx=a.ctx)
    runner = None
    if bool(a.rpc_tracker) != bool(a.rpc_key):
        raise EllmError("--rpc-tracker and --rpc-key go together")
    if a.rpc_tracker:
        from .rpc import RPCRunner

        if a.threads is None:
            raise EllmError("--rpc-tracker needs --threads: the thread count the servers' kernels run with")
        runner = RPCRunner(a.rpc_tracker, a.rpc_key, wl, cpu_label=a.rpc_cpu, threads=a.threads)
        log(f"measuring on {runner.sessions} RPC servers of key {a.rpc_key} ({runner.cpu})")
    db = tune_model(
        a.model, a.output, target=a.target, threads=a.threads, workload=wl, log=log, kernels=a.kernels, options=opts,
        compile_options=compile_options(a, target=a.target), resume=a.resume, bandwidth=runner is None, runner=runner,
    )
    if a.json:
        print(json.dumps(summary(db), indent=1))
    failed = f", {len(db.failures())} failed trials" if db.failures() else ""
    print(f"wrote {a.output} ({len(db.trials())} trials, {len(db.records())} kernels{failed})", file=sys.stderr)
    return 0


def add_report_parser(sub) -> None:
    r = sub.add_parser("tune-report", help="`ellm tune report DB`: best-so-far curves and a table per kernel")
    r.add_argument("db", help="tuning database (JSON lines)")
    r.add_argument("--plot", metavar="FILE.png", help="draw best-so-far curves per strategy (trials, wall time)")
    r.add_argument("--json", action="store_true", help="print the report as JSON")
    r.set_defaults(func=cmd_report)


def cmd_report(a: argparse.Namespace) -> int:
    from pathlib import Path

    from ..errors import EllmError
    from .database import TuningDatabase
    from .report import build_report, format_report, plot_report

    if not Path(a.db).exists():
        raise EllmError(f"no tuning database at {a.db}")
    rep = build_report(TuningDatabase.open(a.db))
    print(json.dumps(rep, indent=1) if a.json else format_report(rep))
    if a.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise EllmError("--plot needs matplotlib (pip install matplotlib)") from None
        plot_report(rep, a.plot)
        print(f"wrote {a.plot}", file=sys.stderr)
    return 0


def summary(db) -> list[dict]:
    """Per kernel (and CPU, threads): default and best time, gain, trials, best knobs."""
    out = []
    trials = db.trials()
    for best in db.records():
        mine = [r for r in trials if r.key() == best.key()]
        out.append({"kernel": best.kernel, "rule": best.rule, "target": best.target, "cpu": best.cpu, "threads": best.threads,
                    "default_us": best.default_seconds * 1e6, "best_us": best.seconds * 1e6, "gain": round(best.gain(), 4),
                    "trials": len(mine), "failed": sum(r.status != "ok" for r in mine), "knobs": best.knobs,
                    "confirmed": best.confirmed, "applied": best.beats_default()})
    return out
