"""TVM TensorIR kernels per op family, as schedule rules."""

from __future__ import annotations

from ..errors import EllmError
from ..targets import TargetPreset
from .amx import AmxGemmRule
from .attention import AttentionDecodeRule, AttentionPrefillRule
from .attention_input import AttentionInputRule
from .elementwise import AddRule, EmbeddingRule, RmsNormRule, SiluMulRule
from .ffn import IntFfnRule
from .gemm import GemmRule
from .gemv import GemvRule
from .rope import KvAppendRule, RopeKvAppendRule, RopeRule
from .rule import KernelRequest, Knob, Rule
from .int_matmul import (
    Avx2GemmRule,
    Avx2GemvRule,
    AvxVnniGemmRule,
    AvxVnniGemvRule,
    VnniGemmRule,
    VnniGemvRule,
)

# First match wins: specialised rules before general ones.
RULES: tuple[Rule, ...] = (
    AmxGemmRule(),  # AMX tiles (prefill)
    IntFfnRule(),
    AttentionInputRule(),
    VnniGemvRule(),  # AVX-512 VNNI
    VnniGemmRule(),
    AvxVnniGemvRule(),  # AVX-VNNI
    AvxVnniGemmRule(),
    Avx2GemvRule(),  # AVX2
    Avx2GemmRule(),
    GemvRule(),
    GemmRule(),
    EmbeddingRule(),
    RmsNormRule(),
    RopeKvAppendRule(),
    RopeRule(),
    KvAppendRule(),
    AttentionDecodeRule(),
    AttentionPrefillRule(),
    SiluMulRule(),
    AddRule(),
)


def select_rule(req: KernelRequest, target: TargetPreset) -> Rule:
    for rule in RULES:
        if rule.applies(req, target):
            return rule
    raise EllmError(f"no kernel rule for {req.kind.value} op {req.describe()} on target {target.name}")


def rule_by_name(name: str) -> Rule:
    for rule in RULES:
        if rule.name == name:
            return rule
    raise KeyError(name)


__all__ = ["RULES", "KernelRequest", "Knob", "Rule", "rule_by_name", "select_rule"]
