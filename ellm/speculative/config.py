"""The speculation settings of a generate call, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import EllmError

DRAFTERS = ("ngram", "model", "cascade")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`chain`: the most drafted tokens one verification step checks (0: speculation off); the controller
    picks each step's length up to it from measured acceptance and verification cost (`adaptive`), or
    always drafts `chain` tokens where a draft is that long. `draft`: where drafts come from (ngram: prompt
    lookup in the prompt and the generated text). `ngram_max`/`ngram_min`: the longest and shortest suffix
    the lookup matches."""

    chain: int = 8
    draft: str = "ngram"
    adaptive: bool = True
    ngram_max: int = 4
    ngram_min: int = 1
    draft_model: str | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.chain <= 31:
            raise EllmError(f"--speculative-chain must be between 0 (off) and 31, got {self.chain}")
        if self.draft not in DRAFTERS:
            raise EllmError(f"--draft must be one of {', '.join(DRAFTERS)}, got {self.draft!r}")
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise EllmError(f"n-gram lengths need 1 <= min <= max <= 16, got {self.ngram_min}..{self.ngram_max}")
        if self.draft in ("model", "cascade") and not self.draft_model:
            raise EllmError(f"--draft {self.draft} needs --draft-model DIR|GGUF (a draft artifact, e.g. from "
                            "`ellm compile --draft-layers L`, or a GGUF to compile into one)")
        if self.draft == "ngram" and self.draft_model:
            raise EllmError("--draft-model is used by --draft model or cascade, not ngram")

    @property
    def on(self) -> bool:
        return self.chain > 0
