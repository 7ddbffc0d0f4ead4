"""Typed CPU target presets: an LLVM CPU, the vector width kernels use, and what the CPU offers."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..errors import EllmError


@dataclass(frozen=True)
class TargetPreset:
    name: str
    mcpu: str
    vector_bits: int  # width kernels vectorise for (512 = AVX-512, 256 = AVX2)
    vnni: bool  # AVX-512 VNNI (vpdpbusd)
    amx: bool  # AMX tiles (tdpbusd / tdpbf16ps)
    description: str

    def __post_init__(self) -> None:
        if self.vector_bits not in (256, 512):
            raise ValueError(f"{self.name}: vector_bits must be 256 or 512")

    @property
    def f32_lanes(self) -> int:
        return self.vector_bits // 32

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

        return sorted(codegen.llvm_get_cpu_features(self.tvm_target()))


PRESETS: dict[str, TargetPreset] = {
    p.name: p
    for p in (
        TargetPreset("znver4", "znver4", 512, True, False, "AMD Zen 4 (EPYC 9004 / Ryzen 7000): AVX-512, VNNI, BF16"),
        TargetPreset("znver3", "znver3", 256, False, False, "AMD Zen 3 (EPYC 7003): AVX2, FMA"),
        TargetPreset(
            "sapphirerapids", "sapphirerapids", 512, True, True, "Intel Xeon 4th gen: AVX-512, VNNI, BF16, AMX"
        ),
        TargetPreset("icelake-server", "icelake-server", 512, True, False, "Intel Xeon 3rd gen: AVX-512, VNNI"),
        TargetPreset("skylake-avx512", "skylake-avx512", 512, False, False, "Intel Xeon Scalable 1st gen: AVX-512"),
        TargetPreset("x86-64-v3", "x86-64-v3", 256, False, False, "generic x86-64-v3: any AVX2/FMA/F16C CPU"),
    )
}


def get_preset(name: str) -> TargetPreset:
    try:
        return PRESETS[name]
    except KeyError:
        raise EllmError(f"unknown target {name!r} (known: auto, {', '.join(PRESETS)})") from None
