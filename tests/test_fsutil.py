"""Atomic writes: the whole new file or the old one, with the mode a plain write would give."""

from __future__ import annotations

import os

import pytest

from ellm.fsutil import atomic_directory, atomic_write_text


def test_atomic_write_gives_the_umask_mode_and_keeps_an_existing_files(tmp_path):
    old = os.umask(0o022)
    try:
        p = tmp_path / "db.json"
        atomic_write_text(p, "one")
        assert p.read_text() == "one" and p.stat().st_mode & 0o777 == 0o644
        p.chmod(0o600)
        atomic_write_text(p, "two")
        assert p.read_text() == "two" and p.stat().st_mode & 0o777 == 0o600
        assert [q.name for q in tmp_path.iterdir()] == ["db.json"]  # no temporary left
    finally:
        os.umask(old)


def test_a_failed_directory_write_leaves_nothing(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_directory(tmp_path / "art") as d:
            (d / "half").write_text("x")
            raise RuntimeError("interrupted")
    assert list(tmp_path.iterdir()) == []
