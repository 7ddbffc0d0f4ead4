"""The artifact manifest checked before it is trusted: the keys the loader reads, with their types; file names
that are plain names inside the artifact directory (no separators, no `..`, no symlinks); every parameter's
offset, size, dtype and shape consistent and inside the weights file. Each failure is one line naming the key."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import ArtifactError

PARAM_DTYPES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "float16", "float32")

# key -> type of the manifest's top level (what Artifact and the engine read)
TOP = {"config": dict, "targets": list, "params": list, "files": dict, "kv_cache": dict, "tokenizer": dict,
       "entries": list, "max_chunk": int, "max_verify": int, "source": dict}
TARGET = {"preset": str, "isa": str, "required_cpu_features": list, "kernels_file": str, "params": list,
          "kernels": list, "activations": dict, "decode_weight_bytes": int}
ENTRY = {"name": str}  # a function of the kernels file the engine calls
OPTIONAL = {"numa": dict, "attention": dict}  # absent or null where the artifact has none
PARAM = {"name": str, "dtype": str, "shape": list, "offset": int, "nbytes": int, "sha256": str}


def _typed(where: str, d: Any, schema: dict[str, type], path: Path) -> None:
    if not isinstance(d, dict):
        raise ArtifactError(f"{path}: manifest {where.rstrip('.') or 'top level'} should be an object, is {type(d).__name__}")
    for key, want in schema.items():
        if key not in d:
            raise ArtifactError(f"{path}: manifest {where}{key} is missing: the artifact is damaged; recompile it")
        v = d[key]
        if not isinstance(v, want) or (want is int and isinstance(v, bool)):
            raise ArtifactError(f"{path}: manifest {where}{key} should be {want.__name__}, is {type(v).__name__}")


def is_digest(s: Any) -> bool:
    return isinstance(s, str) and len(s) == 64 and all(c in "0123456789abcdef" for c in s)


def plain_name(path: Path, name: Any, what: str) -> str:
    """A file name of the artifact: a plain name in its directory, a regular file and not a symlink."""
    if (not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name or "\0" in name):
        raise ArtifactError(f"{path}: manifest names {what} {name!r}, which is not a plain file name")
    f = path / name
    if f.is_symlink():
        raise ArtifactError(f"{path}: artifact file {name} is a symbolic link; artifacts hold plain files only")
    return name


def check_manifest(path: Path, m: dict) -> None:
    """Everything the loader reads, typed; file names plain; parameters inside the weights file."""
    _typed("", m, TOP, path)
    for key, want in OPTIONAL.items():
        if m.get(key) is not None and not isinstance(m[key], want):
            raise ArtifactError(f"{path}: manifest {key} should be {want.__name__}, is {type(m[key]).__name__}")
    for key in ("max_chunk", "max_verify"):
        if m[key] < 1:
            raise ArtifactError(f"{path}: manifest {key} is {m[key]}, must be at least 1")
    for i, e in enumerate(m["entries"]):
        _typed(f"entries[{i}].", e, ENTRY, path)
        if not e["name"].isidentifier():
            raise ArtifactError(f"{path}: manifest entries[{i}].name {e['name']!r} is not a function name")
    for name, digest in m["files"].items():
        plain_name(path, name, "file")
        if not is_digest(digest):
            raise ArtifactError(f"{path}: manifest files.{name} is not a sha256 digest")
    if not m["targets"]:
        raise ArtifactError(f"{path}: manifest targets is empty")
    n_params = len(m["params"])
    for i, t in enumerate(m["targets"]):
        _typed(f"targets[{i}].", t, TARGET, path)
        if not all(isinstance(f, str) for f in t["required_cpu_features"]):
            raise ArtifactError(f"{path}: manifest targets[{i}].required_cpu_features should hold names only")
        if not all(isinstance(k, dict) for k in t["kernels"]):
            raise ArtifactError(f"{path}: manifest targets[{i}].kernels should hold objects only")
        plain_name(path, t["kernels_file"], "kernels file")
        if t["kernels_file"] not in m["files"]:
            raise ArtifactError(f"{path}: kernels file {t['kernels_file']} has no checksum in the manifest")
        if not all(isinstance(j, int) and not isinstance(j, bool) and 0 <= j < n_params for j in t["params"]):
            raise ArtifactError(f"{path}: manifest targets[{i}].params indexes past the {n_params} parameters")
    for i, p in enumerate(m["params"]):
        _typed(f"params[{i}].", p, PARAM, path)
        _check_param(path, i, p)


def _check_param(path: Path, i: int, p: dict) -> None:
    where = f"{path}: manifest params[{i}] ({p['name']})"
    if not is_digest(p["sha256"]):
        raise ArtifactError(f"{where}: sha256 is not a digest")
    if p["dtype"] not in PARAM_DTYPES:
        raise ArtifactError(f"{where} has dtype {p['dtype']!r}")
    shape = p["shape"]
    if not all(isinstance(d, int) and not isinstance(d, bool) and 0 < d < 1 << 40 for d in shape):
        raise ArtifactError(f"{where} has shape {shape}")
    n = int(np.dtype(p["dtype"]).itemsize) * math.prod(shape)
    if p["nbytes"] != n or p["offset"] < 0:
        raise ArtifactError(f"{where}: {p['nbytes']} bytes at offset {p['offset']} for shape {shape} of {p['dtype']}")


def check_params_in_file(path: Path, params, size: int, page: int) -> None:
    """Every parameter (ParamEntry) page-aligned and inside the weights file of `size` bytes."""
    for p in params:
        if p.offset % page or p.offset + p.nbytes > size:
            raise ArtifactError(f"{path}: parameter {p.name} at bytes {p.offset} .. {p.offset + p.nbytes} is not "
                                f"page-aligned inside the {size}-byte weights file: the artifact is damaged; recompile it")
