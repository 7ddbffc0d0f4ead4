"""Detect the host CPU (model, ISA features, cores, caches) and map it to a target preset."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .features import host_cpuinfo_flags
from .presets import PRESETS, TargetPreset


@dataclass(frozen=True)
class HostCPU:
    model_name: str
    llvm_cpu: str
    flags: frozenset[str]
    logical_cpus: int
    caches: dict[str, int] = field(default_factory=dict)  # "L1d", "L2", "L3" -> bytes

    def has(self, cpuinfo_flag: str) -> bool:
        return cpuinfo_flag in self.flags


def _cache_sizes(base: Path = Path("/sys/devices/system/cpu/cpu0/cache")) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for idx in sorted(base.glob("index*")):
        try:
            level = (idx / "level").read_text().strip()
            kind = (idx / "type").read_text().strip()
            size = (idx / "size").read_text().strip()
        except OSError:
            continue
        mult = {"K": 1024, "M": 1024 * 1024}.get(size[-1], 1)
        n = int(size.rstrip("KM")) * mult
        name = f"L{level}" + {"Data": "d", "Instruction": "i"}.get(kind, "")
        sizes[name] = n
    return sizes


def _model_name(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def detect_host() -> HostCPU:
    from tvm.target import codegen

    return HostCPU(
        model_name=_model_name(),
        llvm_cpu=str(codegen.llvm_get_system_cpu()),
        flags=frozenset(host_cpuinfo_flags()),
        logical_cpus=os.cpu_count() or 1,
        caches=_cache_sizes(),
    )


def preset_for_host(host: HostCPU) -> TargetPreset:
    """The most specific preset whose features the host has; generic x86-64-v3 otherwise."""
    if host.llvm_cpu in PRESETS:
        return PRESETS[host.llvm_cpu]
    f = host.flags
    if {"amx_int8", "amx_tile", "avx512_bf16"} <= f:
        return PRESETS["sapphirerapids"]
    if {"avx512f", "avx512_vnni", "avx512_bf16"} <= f:
        return PRESETS["znver4"]
    if {"avx512f", "avx512_vnni"} <= f:
        return PRESETS["icelake-server"]
    if {"avx512f", "avx512bw"} <= f:
        return PRESETS["skylake-avx512"]
    return PRESETS["x86-64-v3"]
