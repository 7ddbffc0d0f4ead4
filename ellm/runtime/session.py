"""A session's KV state in a file (`ellm run --prompt-cache FILE`): the tokens it holds and the cache
tensors, so a later run continues where it stopped without computing its past again.

Layout: MAGIC, the header's length (8 bytes, little endian), the header (JSON), then each tensor's bytes.
Stores keep only the blocks the tokens fill. The header names the artifact and model configuration the
state belongs to and the payload's SHA-256; anything else is refused with one line. Written atomically."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..errors import EllmError
from ..fsutil import atomic_write_bytes

if TYPE_CHECKING:
    from .engine import Engine

MAGIC = b"ELLMKVS\x00"
VERSION = 1


def _config_digest(eng: Engine) -> str:
    """The model configuration the keys were computed with (RoPE scaling included)."""
    return hashlib.sha256(json.dumps(eng.config.to_dict(), sort_keys=True).encode()).hexdigest()[:16]


def _used(spec, arr: np.ndarray, n_blocks: int) -> np.ndarray:
    """The part of a state tensor a session needs (a view): stores only their first n_blocks along "NB"."""
    if "NB" not in spec.shape:
        return arr
    index = [slice(None)] * arr.ndim
    index[spec.shape.index("NB")] = slice(0, n_blocks)
    return arr[tuple(index)]


def save_session(eng: Engine, path: str | Path) -> int:
    """Write the engine's KV state and tokens to `path` (atomically); the bytes written."""
    cache = eng._cache
    n_blocks = eng.kv_plan.n_blocks(max(len(cache.tokens), 1))
    parts, tensors, offset = [], [], 0
    for spec, t in zip(eng.kv_plan.state_tensors(), eng._kv_tensors):
        arr = np.ascontiguousarray(_used(spec, np.from_dlpack(t), n_blocks))
        data = arr.tobytes()
        tensors.append({"name": spec.name, "dtype": str(arr.dtype), "shape": list(arr.shape), "offset": offset,
                        "nbytes": len(data)})
        parts.append(data)
        offset += len(data)
    payload = b"".join(parts)
    header = {
        "format": "ellm-session", "version": VERSION, "artifact": eng.artifact.identity,
        "config": _config_digest(eng), "kv_plan": eng.kv_plan.key(), "tokens": cache.tokens, "exact": cache.exact,
        "hi_block": cache.hi_block, "tensors": tensors, "payload_sha256": hashlib.sha256(payload).hexdigest(),
    }
    head = json.dumps(header).encode()
    blob = MAGIC + struct.pack("<Q", len(head)) + head + payload
    atomic_write_bytes(path, blob)
    return len(blob)


def _refuse(path: Path, why: str) -> EllmError:
    return EllmError(f"prompt cache {path}: {why}")


def load_session(eng: Engine, path: str | Path) -> int:
    """Replace the engine's KV state with the one saved in `path`; the number of tokens it holds. Refuses a
    corrupt file, another format version, another artifact or configuration, or too small a context."""
    path = Path(path)
    try:
        blob = path.read_bytes()
    except OSError as e:
        raise _refuse(path, f"cannot read it ({e.strerror})") from None
    if len(blob) < 16 or blob[:8] != MAGIC:
        raise _refuse(path, "not an eLLM session file")
    (n_head,) = struct.unpack("<Q", blob[8:16])
    try:
        header: dict[str, Any] = json.loads(blob[16 : 16 + n_head])
    except (ValueError, UnicodeDecodeError):
        raise _refuse(path, "its header is corrupt") from None
    if not isinstance(header, dict) or header.get("version") != VERSION:
        raise _refuse(path, f"format version {header.get('version') if isinstance(header, dict) else '?'}, "
                            f"this eLLM reads {VERSION}")
    payload = blob[16 + n_head :]
    if hashlib.sha256(payload).hexdigest() != header.get("payload_sha256"):
        raise _refuse(path, "its contents do not match their checksum (corrupt or truncated)")
    if header.get("artifact") != eng.artifact.identity or header.get("kv_plan") != eng.kv_plan.key():
        raise _refuse(path, "it was saved by another artifact (or another target of it)")
    if header.get("config") != _config_digest(eng):
        raise _refuse(path, "it was saved with another model configuration (RoPE scaling)")
    tokens = header["tokens"]
    if len(tokens) > eng.ctx_size:
        raise _refuse(path, f"it holds {len(tokens)} tokens, more than the context of {eng.ctx_size} "
                            "(use --ctx-size to enlarge it)")
    specs = eng.kv_plan.state_tensors()
    if len(header["tensors"]) != len(specs):
        raise _refuse(path, "its tensors do not match the artifact's KV cache")
    n_blocks = eng.kv_plan.n_blocks(max(len(tokens), 1))
    copies = []
    for spec, rec, t in zip(specs, header["tensors"], eng._kv_tensors):
        dest = _used(spec, np.from_dlpack(t), n_blocks)
        if rec["name"] != spec.name or tuple(rec["shape"]) != dest.shape or rec["dtype"] != str(dest.dtype):
            raise _refuse(path, f"tensor {rec['name']} does not match the artifact's KV cache")
        src = np.frombuffer(payload, dtype=dest.dtype, count=dest.size, offset=rec["offset"]).reshape(dest.shape)
        copies.append((dest, src))
    for dest, src in copies:  # only once everything checked: a refused file leaves the engine as it was
        dest[...] = src
    eng._cache.tokens = [int(x) for x in tokens]
    eng._cache.exact = int(header["exact"])
    eng._cache.hi_block = int(header["hi_block"])
    return len(tokens)
