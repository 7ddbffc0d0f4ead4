"""The draft model of `--draft model|cascade`: an artifact directory, or a GGUF compiled once into the
cache, opened as an engine beside the target's, refused where its vocabulary differs."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import EllmError

if TYPE_CHECKING:
    from ..runtime.engine import Engine


def draft_artifact(path: str | Path, cache: Path) -> Path:
    """The artifact directory for `path`: itself, or for a GGUF file the artifact compiled from it."""
    from ..demo import artifact_for

    return artifact_for(path, cache, "--draft-model", "drafts")


def open_draft(path: str | Path, target: Engine, cache: Path) -> Engine:
    """An engine for the draft model at `path`, with the target's threads and context size."""
    from ..runtime.engine import Engine

    draft = Engine.load(draft_artifact(path, cache), threads=target.threads, ctx_size=target.ctx_size)
    if (draft.config.vocab_size != target.config.vocab_size
            or draft.tokenizer.vocabulary_digest() != target.tokenizer.vocabulary_digest()):
        raise EllmError(f"--draft-model {path}: its vocabulary ({draft.config.vocab_size} tokens) is not the target's "
                        f"({target.config.vocab_size} tokens, same ids for the same texts): speculation needs one tokenizer")
    if draft.max_verify < 2:
        raise EllmError(f"--draft-model {path}: the artifact has no multi-token steps (recompile it)")
    return draft
