"""The manifest's digest envelope (runtime/envelope.py): every byte of the manifest is covered, and with a fleet
key (ELLM_ARTIFACT_KEY) only a manifest signed with it is accepted."""

from __future__ import annotations

import json

import pytest

from ellm.errors import ArtifactError
from ellm.runtime.envelope import KEY_ENV, check_envelope, envelope

RAW = json.dumps({"format": "ellm-artifact", "params": [{"name": "w", "offset": 4096, "nbytes": 128}] * 20}).encode()


def test_every_byte_of_the_manifest_is_covered(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    env = envelope(RAW)
    check_envelope(tmp_path, RAW, env)
    for i in range(len(RAW)):
        for flip in (0x01, 0x80):
            bad = bytearray(RAW)
            bad[i] ^= flip
            with pytest.raises(ArtifactError, match="does not match its digest"):
                check_envelope(tmp_path, bytes(bad), env)
    with pytest.raises(ArtifactError, match="does not match"):
        check_envelope(tmp_path, RAW[:-1], env)
    with pytest.raises(ArtifactError, match="does not match"):
        check_envelope(tmp_path, RAW + b" ", env)


@pytest.mark.parametrize("text", ["", "{", "[]", '{"format": "x", "sha256": "00"}', '{"format": "ellm-manifest-digest"}'])
def test_a_damaged_envelope_is_one_line(tmp_path, text):
    with pytest.raises(ArtifactError, match="manifest.digest is damaged"):
        check_envelope(tmp_path, RAW, text)


def test_a_fleet_key_requires_a_signature_made_with_it(tmp_path, monkeypatch):
    monkeypatch.delenv(KEY_ENV, raising=False)
    unsigned = envelope(RAW)
    monkeypatch.setenv(KEY_ENV, "fleet secret")
    signed = envelope(RAW)
    check_envelope(tmp_path, RAW, signed)
    with pytest.raises(ArtifactError, match="not signed with this fleet's key"):
        check_envelope(tmp_path, RAW, unsigned)
    monkeypatch.setenv(KEY_ENV, "another secret")
    with pytest.raises(ArtifactError, match="not signed with this fleet's key"):
        check_envelope(tmp_path, RAW, signed)
    # someone without the key who edits the manifest and recomputes the digest is still refused
    forged = json.loads(signed)
    edited = RAW.replace(b"4096", b"8192")
    forged["sha256"] = json.loads(envelope(edited))["sha256"]
    monkeypatch.setenv(KEY_ENV, "fleet secret")
    with pytest.raises(ArtifactError, match="not signed"):
        check_envelope(tmp_path, edited, json.dumps(forged))
