"""Evaluations that show what a long-context setting costs in quality: pass-key retrieval and perplexity/KL."""

from .passkey import PasskeyResult, passkey_prompt, run_passkey
from .ppl import PplResult, perplexity

__all__ = ["PasskeyResult", "PplResult", "passkey_prompt", "perplexity", "run_passkey"]
