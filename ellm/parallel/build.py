"""`ellm compile --tp N`: one artifact per rank (rank0/, rank1/, ...) and a group manifest naming them, written
atomically as one directory."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

from ..config import ModelConfig
from ..errors import ArtifactError, EllmError
from ..fsutil import atomic_directory, sha256_file
from .shard import TensorParallel

GROUP = "parallel.json"
FORMAT = "ellm-tensor-parallel"


@dataclass(frozen=True)
class Group:
    """A compiled tensor-parallel group: the whole model's config and every rank's slice and artifact."""

    path: Path
    world: int
    config: ModelConfig
    ranks: tuple[TensorParallel, ...]
    manifests: tuple[str, ...]  # sha256 of each rank's manifest.json, as compiled

    def rank_dir(self, rank: int) -> Path:
        return self.path / f"rank{rank}"

    def verify(self) -> None:
        """Each rank directory holds the artifact compiled for it (its own files are checked when it opens)."""
        for r, digest in enumerate(self.manifests):
            m = self.rank_dir(r) / "manifest.json"
            if not m.is_file() or sha256_file(m) != digest:
                raise ArtifactError(f"{self.path}: rank {r}'s artifact is missing or not the one compiled with "
                                    "this group (recompile with ellm compile --tp)")


def is_group(path: str | Path) -> bool:
    return (Path(path) / GROUP).is_file()


def read_group(path: Path) -> Group:
    try:
        d = json.loads((path / GROUP).read_text())
        if d.get("format") != FORMAT:
            raise ArtifactError(f"{path}: not a tensor-parallel group ({GROUP} has format {d.get('format')!r})")
        ranks = tuple(TensorParallel.from_dict(r) for r in d["ranks"])
        return Group(path, int(d["world"]), ModelConfig.from_dict(d["config"]), ranks, tuple(d["manifests"]))
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ArtifactError(f"{path}: unreadable tensor-parallel group manifest ({e})") from e


def compile_group(model: str | Path | None, out_dir: str | Path, world: int, options, force: bool = False,
                  log: Callable[[str], None] = lambda s: None) -> Group:
    """Compile every rank of a `world`-way tensor-parallel group of `model` with `options` (CompileOptions;
    without a precision recipe: the GGUF's types)."""
    from ..compiler.build import compile_model
    from ..compiler.gguf_file import GGUFFile
    from ..models import resolve_model

    out_dir = Path(out_dir)
    if out_dir.exists() and not force:
        raise EllmError(f"{out_dir} already exists (pass --force to replace it)")
    model_path = resolve_model(model)
    cfg = ModelConfig.from_gguf(GGUFFile(model_path))
    if options.precision is None and options.quant_level is None:
        options = replace(options, precision="source")
    ranks = [TensorParallel.plan(cfg, r, world) for r in range(world)]
    with atomic_directory(out_dir, replace=force) as tmp:
        for tp in ranks:
            log(f"rank {tp.rank} of {world}: query heads {tp.q_heads}, KV heads {tp.kv_heads}, FFN rows {tp.ff}, "
                f"vocabulary rows {tp.vocab}")
            compile_model(model_path, tmp / f"rank{tp.rank}", replace(options, tensor_parallel=tp), log=log)
        doc = {"format": FORMAT, "world": world, "config": cfg.to_dict(), "ranks": [tp.to_dict() for tp in ranks],
               "manifests": [sha256_file(tmp / f"rank{r}" / "manifest.json") for r in range(world)]}
        (tmp / GROUP).write_text(json.dumps(doc, indent=1))
    return read_group(out_dir)
