"""Write an artifact directory atomically: a kernel library per target, weights.bin (page-aligned, shared by
the targets), tokenizer.json, manifest.json."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path
from typing import Any, Iterable

import numpy as np

from ..fsutil import sha256_file
from ..runtime.artifact import FORMAT, FORMAT_VERSION, MANIFEST, PAGE, TOKENIZER, WEIGHTS
from ..runtime.envelope import DIGEST, envelope
from .lower import ParamSpec


def write_weights(path: Path, params: Iterable[tuple[ParamSpec, np.ndarray]]) -> list[dict[str, Any]]:
    """Append each array at the next page boundary; return the manifest's parameter table."""
    table = []
    offset = 0
    with open(path, "wb") as f:
        for spec, arr in params:
            pad = -offset % PAGE
            f.write(b"\0" * pad)
            offset += pad
            data = np.ascontiguousarray(arr).tobytes()
            f.write(data)
            table.append(
                {
                    "name": spec.name,
                    "dtype": spec.dtype,
                    "shape": list(spec.shape),
                    "offset": offset,
                    "nbytes": len(data),
                    "sha256": hashlib.sha256(data).hexdigest(),  # checked on the bytes that run (runtime/artifact.py)
                    "sources": list(spec.sources),
                    "qtype": spec.qtype,
                    "component": spec.component,
                    "layout": spec.layout,
                }
            )
            offset += len(data)
        f.write(b"\0" * (-offset % PAGE))
    return table


def write_manifest(out: Path, manifest: dict[str, Any], kernel_files: list[str]) -> None:
    """Record every file's checksum and write the manifest last (inside the not-yet-renamed directory), then
    its digest envelope (runtime/envelope.py)."""
    files = {name: sha256_file(out / name) for name in (*kernel_files, WEIGHTS, TOKENIZER)}
    full = {"format": FORMAT, "format_version": FORMAT_VERSION, "created_unix": int(time.time()), **manifest}
    full["files"] = files
    raw = json.dumps(full, indent=1).encode()
    (out / MANIFEST).write_bytes(raw)
    (out / DIGEST).write_text(envelope(raw))
