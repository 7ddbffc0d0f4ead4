"""Command-line options of precision plans: `ellm compile --precision auto --budget-*`, `ellm inspect --precision`."""

from __future__ import annotations

import argparse
import sys


def add_precision_args(c: argparse.ArgumentParser) -> None:
    c.add_argument("--precision", choices=["source", "auto"], default=None,
                   help="auto (the default unless --quant-level is given): weight and KV types per layer from a measured "
                        "sensitivity analysis, under the byte budget (first compile of a model: a few minutes, then "
                        "cached); source: the GGUF's types and the rule-based KV plan")
    add_budget_args(c)


def add_budget_args(c: argparse.ArgumentParser) -> None:
    from ..cli import _positive_int

    b = c.add_mutually_exclusive_group()
    b.add_argument("--budget-mb", type=float, default=None, help="auto: bytes read per decoded token, in MB (10^6)")
    b.add_argument("--budget-ratio", type=float, default=None,
                   help="auto: budget as a share of the source plan's bytes per token (GGUF types, rule-based KV; "
                        "default 1.0)")
    c.add_argument("--budget-ctx", type=_positive_int, default=8192, help="auto: the context the budget is counted at (8192)")
    c.add_argument("--calibration", metavar="FILE", default=None,
                   help="auto: calibration text (default: Python's language reference, which every install has)")


def cmd_inspect_precision(a: argparse.Namespace) -> int:
    from ..compiler.build import CompileOptions
    from .report import inspect_precision

    options = CompileOptions(precision="auto", budget_mb=a.budget_mb, budget_ratio=a.budget_ratio,
                             budget_ctx=a.budget_ctx, calibration=a.calibration)
    print(inspect_precision(a.model, options, a.plot, a.json, log=lambda s: print(s, file=sys.stderr)))
    return 0
