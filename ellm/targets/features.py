"""CPU ISA features: LLVM feature names (what code is compiled for) <-> Linux /proc/cpuinfo flags (what a host has)."""

from __future__ import annotations

import fnmatch
import os
from pathlib import Path

# Comma-separated /proc/cpuinfo flags (shell patterns allowed: `avx512*,amx*`) this process treats the host
# as lacking: to run the next-best target of a multi-target artifact, or the test suite as an AVX2-only CPU.
MASK_ENV = "ELLM_CPU_MASK"

# Compute ISA features generated code may use. System features (xsave, rdpid, ...) never appear in
# kernels and are left out so an artifact does not demand what it cannot use.
LLVM_TO_CPUINFO: dict[str, str] = {
    "sse4.1": "sse4_1",
    "sse4.2": "sse4_2",
    "popcnt": "popcnt",
    "avx": "avx",
    "avx2": "avx2",
    "fma": "fma",
    "f16c": "f16c",
    "bmi": "bmi1",
    "bmi2": "bmi2",
    "lzcnt": "abm",
    "movbe": "movbe",
    "avx512f": "avx512f",
    "avx512cd": "avx512cd",
    "avx512bw": "avx512bw",
    "avx512dq": "avx512dq",
    "avx512vl": "avx512vl",
    "avx512ifma": "avx512ifma",
    "avx512vbmi": "avx512vbmi",
    "avx512vbmi2": "avx512_vbmi2",
    "avx512bitalg": "avx512_bitalg",
    "avx512vpopcntdq": "avx512_vpopcntdq",
    "avx512vnni": "avx512_vnni",
    "avx512bf16": "avx512_bf16",
    "avx512fp16": "avx512_fp16",
    "avxvnni": "avx_vnni",
    "gfni": "gfni",
    "vaes": "vaes",
    "vpclmulqdq": "vpclmulqdq",
    "amx-tile": "amx_tile",
    "amx-int8": "amx_int8",
    "amx-bf16": "amx_bf16",
}


def compute_features(llvm_features: set[str] | list[str]) -> list[str]:
    """The compute ISA features (LLVM names) among a target's features, sorted."""
    return sorted(f for f in llvm_features if f in LLVM_TO_CPUINFO)


def host_cpuinfo_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """Flags of the first CPU in /proc/cpuinfo (empty if unreadable)."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags") or line.startswith("Features"):
            return set(line.split(":", 1)[1].split())
    return set()


def cpu_mask() -> list[str]:
    """The patterns of ELLM_CPU_MASK."""
    return [p.strip() for p in os.environ.get(MASK_ENV, "").split(",") if p.strip()]


def host_flags() -> set[str]:
    """This host's cpuinfo flags, less those ELLM_CPU_MASK hides."""
    mask = cpu_mask()
    return {f for f in host_cpuinfo_flags() if not any(fnmatch.fnmatchcase(f, p) for p in mask)}


def missing_features(required_llvm: list[str], host_flags: set[str]) -> list[str]:
    """Required features (LLVM names) the host lacks."""
    return [f for f in required_llvm if LLVM_TO_CPUINFO.get(f, f) not in host_flags]
