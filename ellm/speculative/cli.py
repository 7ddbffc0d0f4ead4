"""The speculation and cache-reuse options of `ellm run` (and of commands that run an engine alike)."""

from __future__ import annotations

import argparse

from ..errors import EllmError
from .config import DRAFTERS, SpeculativeConfig


def add_speculative_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculative-chain", type=int, default=0, metavar="K",
                   help="verify drafted chains of up to K tokens in one step (0: off, the default); the length "
                        "adapts to the measured acceptance and verification cost")
    p.add_argument("--draft", choices=DRAFTERS, default="ngram",
                   help="where drafts come from: ngram, prompt lookup in the prompt and the text generated so far; "
                        "model, a draft model (--draft-model); cascade, prompt lookup where it matches, else the model")
    p.add_argument("--draft-model", metavar="DIR|GGUF",
                   help="the draft model: an artifact (e.g. `ellm compile --draft-layers L`) or a GGUF, compiled once "
                        "into the cache; it must share the target's vocabulary")
    p.add_argument("--fixed-chain", action="store_true",
                   help="always verify the whole draft (up to K), not the length the controller would choose")
    p.add_argument("--cache-reuse", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of the longest cached prefix, decoded tokens included (default on); off, "
                        "only prompt tokens, which reproduces a fresh run bit for bit")
    p.add_argument("--prompt-cache", metavar="FILE",
                   help="start from the session saved in FILE (if it exists; the same artifact) and save the session "
                        "there afterwards: a later run with a prompt that extends this one computes only what is new")


def speculative_option(a: argparse.Namespace) -> SpeculativeConfig | None:
    if a.speculative_chain < 0:
        raise EllmError(f"--speculative-chain must be >= 0, got {a.speculative_chain}")
    if a.speculative_chain == 0:
        if a.fixed_chain or a.draft_model:
            raise EllmError(f"{'--fixed-chain' if a.fixed_chain else '--draft-model'} needs --speculative-chain K with K >= 1")
        return None
    return SpeculativeConfig(chain=a.speculative_chain, draft=a.draft, adaptive=not a.fixed_chain,
                             draft_model=a.draft_model)
