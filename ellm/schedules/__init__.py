"""TVM TensorIR kernels per op family, as schedule rules."""

from __future__ import annotations

from ..errors import EllmError
from ..targets import IsaClass, TargetPreset
from .amx import AmxGemmRule
from .attention import AttentionDecodeRule, AttentionPrefillRule
from .attention_input import AttentionInputRule
from .elementwise import AddRule, EmbeddingRule, RmsNormRule, SiluMulRule, VocabMergeRule
from .ffn import IntFfnRule
from .gemm import GemmRule
from .gemv import GemvRule
from .rope import KvAppendRule, RopeKvAppendRule, RopeRule
from .rule import KernelRequest, Knob, Rule
from .int_matmul import IntGemmRule, IntGemvRule

# First match wins: specialised rules before general ones.
RULES: tuple[Rule, ...] = (
    AmxGemmRule(),  # AMX tiles (prefill)
    IntFfnRule(),
    AttentionInputRule(),
    # the integer matmuls of each dot-product class, best first (a target gets its own class's)
    IntGemvRule(IsaClass.AVX512_VNNI),
    IntGemmRule(IsaClass.AVX512_VNNI),
    IntGemvRule(IsaClass.AVX_VNNI),
    IntGemmRule(IsaClass.AVX_VNNI),
    IntGemvRule(IsaClass.AVX2),
    IntGemmRule(IsaClass.AVX2),
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
    VocabMergeRule(),
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
