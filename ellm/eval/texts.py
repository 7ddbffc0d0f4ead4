"""Long real texts that every install has, for evaluations and tests."""

from __future__ import annotations

from pathlib import Path

from ..errors import EllmError


def opticks() -> Path:
    """Isaac Newton's Opticks (Project Gutenberg, 567 KB of English prose), shipped inside apache-tvm-ffi."""
    import tvm_ffi

    path = Path(tvm_ffi.__file__).parent / "3rdparty" / "libbacktrace" / "Isaac.Newton-Opticks.txt"
    if not path.is_file():
        raise EllmError(f"long evaluation text not found: {path}")
    return path
