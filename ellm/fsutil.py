"""Atomic file and directory writes: a reader sees the old state or the complete new one, never a half."""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` through a temporary sibling and one rename. The file gets the mode a plain
    open() would give it (an existing file's own), not mkstemp's owner-only 0600."""
    path = Path(path)
    mode = path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fchmod(f.fileno(), mode)
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def clean_stale(final: Path) -> list[Path]:
    """Remove the temporary siblings (`.NAME.PID.*.partial` / `.old`) that writers of `final` left when they
    were killed (SIGKILL, power loss: no chance to clean up); those of a process still alive are kept."""
    removed = []
    for p in final.parent.glob(f".{final.name}.*"):
        parts = p.name[len(final.name) + 2 :].split(".")
        if len(parts) == 3 and parts[0].isdigit() and parts[2] in ("partial", "old") and not _alive(int(parts[0])):
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


@contextmanager
def atomic_directory(final: str | Path, replace: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary sibling directory; on success it becomes `final` in one rename.

    On any error (or interrupt) the temporary directory is removed and `final` is untouched. A writer that
    was killed outright leaves its temporary directory, named with its PID; the next writer removes it.
    With `replace`, an existing `final` is swapped out and removed after the new one is in place.
    """
    final = Path(final).absolute()
    final.parent.mkdir(parents=True, exist_ok=True)
    clean_stale(final)
    stem = f".{final.name}.{os.getpid()}."
    tmp = Path(tempfile.mkdtemp(prefix=stem, suffix=".partial", dir=final.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the result is an ordinary directory
    old = None
    try:
        yield tmp
        for p in tmp.iterdir():
            if p.is_file():
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        fsync_dir(tmp)
        if final.exists():
            if not replace:
                raise FileExistsError(final)
            old = Path(tempfile.mkdtemp(prefix=stem, suffix=".old", dir=final.parent))
            os.rmdir(old)
            os.replace(final, old)
        os.replace(tmp, final)
        fsync_dir(final.parent)
    except BaseException:
        if old is not None and old.exists() and not final.exists():  # interrupted between the two renames
            os.replace(old, final)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()
