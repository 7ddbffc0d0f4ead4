"""Linux hands AMX tile state to a process only after it asks (arch_prctl ARCH_REQ_XCOMP_PERM)."""

from __future__ import annotations

import ctypes
import platform

from ..errors import ArtifactError

SYS_ARCH_PRCTL = 158  # x86-64
ARCH_REQ_XCOMP_PERM = 0x1023
XFEATURE_XTILEDATA = 18


def request_amx_permission() -> None:
    """Ask the kernel for AMX tile data; without it the first tile instruction raises SIGILL."""
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        raise ArtifactError("AMX kernels need Linux on x86-64")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.syscall(SYS_ARCH_PRCTL, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0:
        raise ArtifactError(f"the kernel refused AMX tile data (arch_prctl errno {ctypes.get_errno()})")
