"""The manifest's own integrity: `manifest.digest`, a small envelope holding the sha256 of manifest.json's exact
bytes and, where the fleet shares a key (`ELLM_ARTIFACT_KEY`), their HMAC-SHA256. The manifest holds every other
file's checksum and every parameter's, so the envelope covers the whole artifact. A digest alone catches damage
and careless edits; only the HMAC stops someone who can rewrite both files."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path

from ..errors import ArtifactError

DIGEST = "manifest.digest"
ENVELOPE_FORMAT = "ellm-manifest-digest"
KEY_ENV = "ELLM_ARTIFACT_KEY"


def _key() -> bytes | None:
    key = os.environ.get(KEY_ENV)
    return key.encode() if key else None


def envelope(raw: bytes) -> str:
    """The envelope of manifest bytes `raw` (with the HMAC where a key is set)."""
    key = _key()
    mac = hmac.new(key, raw, hashlib.sha256).hexdigest() if key else None
    return json.dumps({"format": ENVELOPE_FORMAT, "sha256": hashlib.sha256(raw).hexdigest(), "hmac_sha256": mac})


def check_envelope(path: Path, raw: bytes, text: str | None) -> None:
    """Refuse manifest bytes `raw` that do not match the envelope text (None: the file is missing)."""
    if text is None:
        raise ArtifactError(f"{path}: {DIGEST} is missing (an artifact from an older eLLM, or damaged): recompile it")
    try:
        env = json.loads(text)
        ok = isinstance(env, dict) and env.get("format") == ENVELOPE_FORMAT and isinstance(env.get("sha256"), str)
    except ValueError:
        ok = False
    if not ok:
        raise ArtifactError(f"{path}: {DIGEST} is damaged: recompile the artifact")
    if not hmac.compare_digest(env["sha256"], hashlib.sha256(raw).hexdigest()):
        raise ArtifactError(f"{path}: manifest.json does not match its digest: the artifact was modified or is "
                            "damaged; recompile it")
    key = _key()
    if key is not None:
        mac = env.get("hmac_sha256")
        if not isinstance(mac, str) or not hmac.compare_digest(mac, hmac.new(key, raw, hashlib.sha256).hexdigest()):
            raise ArtifactError(f"{path}: manifest.json is not signed with this fleet's key ({KEY_ENV}): refusing it")


def read_plain(path: Path, name: str) -> str | None:
    """A small file of the artifact as text (None if missing); a symlink is refused."""
    f = path / name
    if f.is_symlink():
        raise ArtifactError(f"{path}: {name} is a symbolic link; artifacts hold plain files only")
    try:
        return f.read_text()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path}: {name} is unreadable: {e}") from None
