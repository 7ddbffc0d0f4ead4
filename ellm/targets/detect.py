"""Detect the host CPU (model, ISA features, cores, caches) and map it to a target preset."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from .features import host_flags, missing_features
from .presets import FALLBACK_ORDER, PRESETS, TargetPreset


@dataclass(frozen=True)
class HostCPU:
    model_name: str
    llvm_cpu: str
    flags: frozenset[str]  # /proc/cpuinfo flags, less ELLM_CPU_MASK
    logical_cpus: int
    caches: dict[str, int] = field(default_factory=dict)  # "L1d", "L2", "L3" -> bytes

    def has(self, cpuinfo_flag: str) -> bool:
        return cpuinfo_flag in self.flags

    def record(self) -> dict:
        """What a benchmark JSON says about the machine it ran on (runs from several hosts sit side by side)."""
        return {"model_name": self.model_name, "llvm_cpu": self.llvm_cpu, "logical_cpus": self.logical_cpus,
                "caches": dict(self.caches), "preset": preset_for_host(self).name}

    @property
    def identity(self) -> str:
        """The CPU model as tuning records name it: the model name with LLVM's name for the core (virtual
        machines often report only "AMD EPYC", whatever the generation)."""
        return f"{self.model_name} [{self.llvm_cpu}]"

    @property
    def compute_flags(self) -> list[str]:
        """The flags that decide which code runs fast here (vector, dot-product and matrix extensions)."""
        keep = ("avx", "amx", "fma", "f16c", "bmi", "sse", "vnni", "vpclmul", "gfni", "vaes")
        return sorted(f for f in self.flags if f.startswith(keep))

    def can_run(self, preset: TargetPreset) -> bool:
        return not missing_features(preset.required_cpu_features, set(self.flags))


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
        flags=frozenset(host_flags()),
        logical_cpus=os.cpu_count() or 1,
        caches=_cache_sizes(),
    )


def preset_for_host(host: HostCPU) -> TargetPreset:
    """The preset of the host's own LLVM CPU if it has one (and no feature of it is masked), else the first
    preset of FALLBACK_ORDER whose features the host has; generic x86-64-v3 as the last resort."""
    own = PRESETS.get(host.llvm_cpu)
    if own is not None and host.can_run(own):
        return own
    for name in FALLBACK_ORDER:
        if host.can_run(PRESETS[name]):
            return PRESETS[name]
    return PRESETS["x86-64-v3"]


def available_memory() -> int:
    """Bytes the kernel reports as available (Linux MemAvailable; else all physical memory)."""
    import os

    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
