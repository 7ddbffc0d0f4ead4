"""A GGUF opened the one way every command opens one: header and tensor table checked, the typed config, the
tokenizer, and the graph imported with every weight's format checked, all before a weight is packed or a
kernel compiled; so whatever is wrong with the file is found here, as one line."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..config import ModelConfig
from ..models import resolve_model
from ..runtime.tokenizer import Tokenizer
from .gguf_file import GGUFFile
from .graph import Graph
from .import_llama import import_llama


@dataclass(frozen=True)
class SourceModel:
    path: Path
    gguf: GGUFFile
    config: ModelConfig  # of the layers kept (all, or a draft's first ones)
    file_layers: int  # the layers the file holds (a draft keeps the first config.n_layers of them)
    tokenizer: Tokenizer
    graph: Graph  # as imported, before any pass


def open_model(model: str | Path | None, first_layers: int | None = None) -> SourceModel:
    """`model`: a GGUF path, or None for the default model. `first_layers`: keep only these (a draft)."""
    path = resolve_model(model)
    gf = GGUFFile(path)
    full = ModelConfig.from_gguf(gf)
    cfg = full if first_layers is None else full.first_layers(first_layers)
    return SourceModel(path, gf, cfg, full.n_layers, Tokenizer.from_gguf(gf), import_llama(gf, cfg))
