"""The sampling options of `ellm run` (runtime/sampling.py) and the stop strings (runtime/textstream.py)."""

from __future__ import annotations

import argparse

from .sampling import SamplingConfig
from .textstream import check_stops


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    d = SamplingConfig()
    p.add_argument("--temp", type=float, default=d.temperature, help="sampling temperature (0 = greedy, the default)")
    p.add_argument("--seed", type=int, default=None, help="sampling seed")
    p.add_argument("--top-k", type=int, default=d.top_k, help="sample among the K most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=d.top_p,
                   help="sample among the most likely tokens whose mass reaches P (1 = off)")
    p.add_argument("--min-p", type=float, default=d.min_p,
                   help="drop tokens less likely than P times the most likely one (0 = off)")
    p.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty,
                   help="penalise tokens seen in the last --repeat-last-n tokens (1 = off)")
    p.add_argument("--repeat-last-n", type=int, default=d.penalty_last_n,
                   help=f"the window the penalties look at (default {d.penalty_last_n}, -1 = everything)")
    p.add_argument("--presence-penalty", type=float, default=d.presence_penalty,
                   help="subtracted from the logit of every token seen in the window")
    p.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty,
                   help="subtracted once per occurrence in the window")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop before this text (repeatable; matched across tokens, never printed)")


def sampling_option(a: argparse.Namespace) -> SamplingConfig:
    return SamplingConfig(temperature=a.temp, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                          repeat_penalty=a.repeat_penalty, presence_penalty=a.presence_penalty,
                          frequency_penalty=a.frequency_penalty, penalty_last_n=a.repeat_last_n, seed=a.seed)


def stops_option(a: argparse.Namespace) -> tuple[str, ...]:
    return check_stops(a.stop)
