"""Typed CPU target presets: a name, the LLVM CPU it compiles for, and what that CPU offers.

What a preset offers (ISA class, vector width, AMX) is read from LLVM's definition of its CPU, so a
preset cannot claim a feature its code is not compiled with.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..errors import EllmError
from .features import compute_features
from .isa import IsaClass, isa_class_of


@dataclass(frozen=True)
class TargetPreset:
    name: str
    mcpu: str
    description: str
    # Software prefetch of weight streams: prefetchnta (bypassing the caches) measured faster on AMD Zen 4;
    # on an Intel Xeon (Emerald Rapids) prefetcht0 streamed a GEMV at 20-22 GB/s against 14-15 with nta.
    prefetch_nta: bool = False

    def __post_init__(self) -> None:
        if not self.name or not self.mcpu:
            raise ValueError("a target preset needs a name and an LLVM CPU")

    def tvm_target(self, num_cores: int | None = None):
        import tvm

        spec = {"kind": "llvm", "mcpu": self.mcpu}
        if num_cores:
            spec["num-cores"] = int(num_cores)
        return tvm.target.Target(spec)

    def target_json(self) -> dict:
        return {"kind": "llvm", "mcpu": self.mcpu}

    @cached_property
    def llvm_features(self) -> list[str]:
        from tvm.target import codegen

        return sorted(str(f) for f in codegen.llvm_get_cpu_features(self.tvm_target()))

    @cached_property
    def required_cpu_features(self) -> list[str]:
        """The compute features (LLVM names) a CPU must have to run this preset's code."""
        return compute_features(self.llvm_features)

    def has(self, *llvm_features: str) -> bool:
        return set(llvm_features) <= set(self.llvm_features)

    @cached_property
    def isa(self) -> IsaClass | None:
        """The best integer dot-product class (targets/isa.py); None for CPUs below AVX2."""
        return isa_class_of(self.llvm_features)

    @property
    def amx(self) -> bool:
        return self.isa is IsaClass.AMX

    @property
    def vector_bits(self) -> int:
        """Width the float kernels vectorise for: 512 with AVX-512, else 256."""
        return 512 if self.has("avx512f") else 256

    @property
    def f32_lanes(self) -> int:
        return self.vector_bits // 32

    @property
    def rank(self) -> tuple[int, int, int]:
        """Order of preference among targets a CPU can run: ISA class, vector width, then breadth."""
        return (int(self.isa or 0), self.vector_bits, len(self.required_cpu_features))


PRESETS: dict[str, TargetPreset] = {
    p.name: p
    for p in (
        TargetPreset("sapphirerapids", "sapphirerapids", "Intel Xeon 4th/5th gen: AVX-512 VNNI, BF16, AMX"),
        TargetPreset("znver5", "znver5", "AMD Zen 5 (EPYC 9005): AVX-512 VNNI, VBMI, BF16, AVX-VNNI", prefetch_nta=True),
        TargetPreset("znver4", "znver4", "AMD Zen 4 (EPYC 9004 / Ryzen 7000): AVX-512 VNNI, VBMI, BF16", prefetch_nta=True),
        TargetPreset("icelake-server", "icelake-server", "Intel Xeon 3rd gen: AVX-512 VNNI, VBMI"),
        TargetPreset("cascadelake", "cascadelake", "Intel Xeon 2nd gen: AVX-512 VNNI, no VBMI"),
        TargetPreset("skylake-avx512", "skylake-avx512", "Intel Xeon Scalable 1st gen: AVX-512, no VNNI"),
        TargetPreset("alderlake", "alderlake", "Intel Core 12th gen and later: AVX2, AVX-VNNI (256-bit)"),
        TargetPreset("znver3", "znver3", "AMD Zen 3 (EPYC 7003): AVX2, FMA", prefetch_nta=True),
        TargetPreset("znver2", "znver2", "AMD Zen 2 (EPYC 7002): AVX2, FMA", prefetch_nta=True),
        TargetPreset("haswell", "haswell", "Intel Haswell/Broadwell Xeon (E5 v3/v4): AVX2, FMA"),
        TargetPreset("x86-64-v3", "x86-64-v3", "generic x86-64-v3: any AVX2/FMA/F16C CPU"),
    )
}

# For a host whose LLVM CPU has no preset: the first of these whose features it has. Vendor-neutral
# presets come before vendor-specific ones of the same class.
FALLBACK_ORDER = ("sapphirerapids", "znver4", "icelake-server", "cascadelake", "skylake-avx512", "alderlake", "x86-64-v3")


def get_preset(name: str) -> TargetPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise EllmError(f"unknown target {name!r} (known: auto, {', '.join(PRESETS)})") from None
