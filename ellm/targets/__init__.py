"""CPU detection and target presets."""

from .detect import HostCPU, detect_host, preset_for_host
from .features import MASK_ENV, compute_features, cpu_mask, host_cpuinfo_flags, host_flags, missing_features
from .isa import IsaClass, dot_class, isa_class_of
from .presets import PRESETS, TargetPreset, get_preset


def resolve_target(name: str) -> TargetPreset:
    """`auto` -> the preset for this host; otherwise the named preset."""
    if name == "auto":
        return preset_for_host(detect_host())
    return get_preset(name)


__all__ = [
    "MASK_ENV",
    "PRESETS",
    "HostCPU",
    "IsaClass",
    "TargetPreset",
    "compute_features",
    "cpu_mask",
    "detect_host",
    "dot_class",
    "get_preset",
    "host_cpuinfo_flags",
    "host_flags",
    "isa_class_of",
    "missing_features",
    "preset_for_host",
    "resolve_target",
]
