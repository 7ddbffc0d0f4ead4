"""CPU detection and target presets."""

from .detect import HostCPU, detect_host, preset_for_host
from .features import compute_features, host_cpuinfo_flags, missing_features
from .presets import PRESETS, TargetPreset, get_preset


def resolve_target(name: str) -> TargetPreset:
    """`auto` -> the preset for this host; otherwise the named preset."""
    if name == "auto":
        return preset_for_host(detect_host())
    return get_preset(name)


__all__ = [
    "PRESETS",
    "HostCPU",
    "TargetPreset",
    "compute_features",
    "detect_host",
    "get_preset",
    "host_cpuinfo_flags",
    "missing_features",
    "preset_for_host",
    "resolve_target",
]
