"""ISA classes of x86 integer kernels: which dot-product instructions a target offers, best last.

An ISA class is a set of LLVM features. A target belongs to the best class whose features it has;
schedule rules name the class they need, and the rule order tries the best class first.
"""

from __future__ import annotations

import enum


class IsaClass(enum.IntEnum):
    """Integer dot-product paths, ordered: a higher class is preferred where the CPU has it."""

    AVX2 = 1  # vpmaddubsw + vpmaddwd (256-bit): any AVX2 CPU (Haswell, Zen 1-3)
    AVX_VNNI = 2  # vpdpbusd on ymm (VEX): Alder Lake and later client cores, Sierra Forest
    AVX512_VNNI = 3  # vpdpbusd on zmm: Cascade Lake, Ice Lake, Zen 4/5
    AMX = 4  # AVX-512 VNNI plus AMX tiles (tdpbsud) for prefill: Sapphire Rapids and later

    @property
    def features(self) -> frozenset[str]:
        """LLVM features the class needs (those of the classes below it are not implied)."""
        return _FEATURES[self]

    @property
    def label(self) -> str:
        return _LABELS[self]


_BASE = frozenset({"avx2", "fma", "f16c"})
_AVX512 = _BASE | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni"}
_FEATURES = {
    IsaClass.AVX2: _BASE,
    IsaClass.AVX_VNNI: _BASE | {"avxvnni"},
    IsaClass.AVX512_VNNI: _AVX512,
    IsaClass.AMX: _AVX512 | {"amx-tile", "amx-int8"},
}
_LABELS = {
    IsaClass.AVX2: "AVX2",
    IsaClass.AVX_VNNI: "AVX-VNNI",
    IsaClass.AVX512_VNNI: "AVX-512 VNNI",
    IsaClass.AMX: "AMX",
}


def isa_class_of(llvm_features) -> IsaClass | None:
    """The best class whose features are all in `llvm_features`; None below AVX2."""
    have = set(llvm_features)
    best = None
    for c in IsaClass:
        if c.features <= have:
            best = c
    return best


def dot_class(isa: IsaClass) -> IsaClass:
    """The class whose vector dot products a target of class `isa` uses (AMX targets: AVX-512 VNNI)."""
    return IsaClass.AVX512_VNNI if isa is IsaClass.AMX else isa
