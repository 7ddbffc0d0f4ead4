"""The draft model of `--draft model|cascade`: an artifact directory, or a GGUF compiled once into the
cache, opened as an engine beside the target's, refused where its vocabulary differs."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ..errors import EllmError

if TYPE_CHECKING:
    from ..runtime.engine import Engine


def draft_artifact(path: str | Path, cache: Path) -> Path:
    """The artifact directory for `path`: itself, or for a GGUF file the artifact compiled from it (with the
    default options, for this host) under `cache`, compiled on first use."""
    from .. import __version__

    p = Path(path)
    if p.is_dir():
        return p
    if not p.is_file():
        raise EllmError(f"--draft-model {path}: no such artifact directory or GGUF file")
    from ..compiler.build import CompileOptions, compile_model
    from ..compiler.gguf_file import GGUFFile
    from ..targets import resolve_target

    digest = GGUFFile(p).sha256()[:16]
    out = cache / "drafts" / f"{digest}-{__version__}-{resolve_target('auto').name}"
    if not (out / "manifest.json").is_file():
        print(f"compiling the draft model {p.name} into {out} (once)", file=sys.stderr)
        compile_model(p, out, CompileOptions(target="auto"), force=out.exists(),
                      log=lambda s: print(s, file=sys.stderr))
    return out


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
