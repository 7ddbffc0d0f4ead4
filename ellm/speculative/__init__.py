"""Speculative chains: a drafter proposes tokens, the target verifies them in one weight pass (the verify
entry, whose rows equal decode steps bit for bit), accepted tokens keep their KV, the rest roll back."""

from .accept import accept_greedy, accept_sampled
from .config import DRAFTERS, SpeculativeConfig
from .controller import ChainController
from .ngram import NgramIndex

__all__ = ["DRAFTERS", "ChainController", "NgramIndex", "SpeculativeConfig", "accept_greedy", "accept_sampled"]
