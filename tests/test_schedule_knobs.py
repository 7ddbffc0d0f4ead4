"""Every knob of every rule changes the generated code, and the defaults are what `default_knobs` says.

Only assembly is compared, so each rule is compiled for a preset where it applies, whatever the host.
"""

from __future__ import annotations

import functools

import pytest
from kernels import asm, build_request, matmul_request

from ellm.compiler.graph import OpKind, TensorType
from ellm.quant import QuantType
from ellm.kv.plan import KVPlan, KVType
from ellm.schedules import RULES, KernelRequest, select_rule
from ellm.targets import get_preset
from kvcache import cache_attrs

PLAN = KVPlan.uniform(2, 2, 64, KVType.Q8, KVType.Q4, max_chunk=256)
ZEN4, ADL, V3, SPR = (get_preset(n) for n in ("znver4", "alderlake", "x86-64-v3", "sapphirerapids"))


def _attention(m):
    return KernelRequest(
        OpKind.ATTENTION,
        m,
        (TensorType(("T", 256)), TensorType((2, 2, "C", 64), "float16")),
        (None, None),
        (TensorType(("T", 256)),),
        attrs=tuple(sorted((("n_heads", 4), *cache_attrs(PLAN, 0)))),
    )


def _tiled(m):
    return matmul_request(QuantType.Q4_1, 256, 512, m=m, layout="tile16", act_bits=16)


# rule name -> (a request it is selected for, the preset it is compiled for)
REQUESTS = {
    "gemv": (matmul_request(QuantType.Q4_1, 256, 512, m=1), ZEN4),
    "gemm": (matmul_request(QuantType.Q4_1, 192, 512, m=None), ZEN4),
    "vnni_gemv": (_tiled(1), ZEN4),
    "vnni_gemm": (_tiled(None), ZEN4),
    "avxvnni_gemv": (_tiled(1), ADL),
    "avxvnni_gemm": (_tiled(None), ADL),
    "avx2_gemv": (_tiled(1), V3),
    "avx2_gemm": (_tiled(None), V3),
    "amx_gemm": (_tiled(None), SPR),
    "attention_decode": (_attention(1), ZEN4),
    "int_ffn": (KernelRequest(
        OpKind.FFN, None, (TensorType(("T", 256)),), (None,), (TensorType(("T", 256)),), QuantType.Q4_1, (1024, 256),
        ("norm",), (("act_bits", 16), ("d_ff", 512), ("layout", "tile16"), ("norm_eps", 1e-5)),
        ((QuantType.Q4_1, 256, 512, "tile16"),),
    ), ZEN4),
    "attention_input": (KernelRequest(
        OpKind.ATTN_INPUT, None, (TensorType((2, 2, "C", 64), "float16"), TensorType(("T", 256))), (None, None),
        (TensorType(("T", 256)), TensorType((2, 2, "C", 64), "float16")), QuantType.Q4_1, (512, 256), ("norm",),
        tuple(sorted((("act_bits", 16), ("layout", "tile16"), ("n_heads", 4), ("n_kv_heads", 2), ("neox", False),
                      ("norm_eps", 1e-5), ("rope_dim", 64), *cache_attrs(PLAN, 0)))),
    ), ZEN4),
    "rmsnorm": (KernelRequest(OpKind.RMSNORM, None, (TensorType(("T", 512)),), (None,), (TensorType(("T", 512)),),
                              attrs=(("eps", 1e-5),)), ZEN4),
    "silu_mul": (KernelRequest(OpKind.SILU_MUL, None, (TensorType(("T", 512)),) * 2, (None, None), (TensorType(("T", 512)),)), ZEN4),
    "add": (KernelRequest(OpKind.ADD, None, (TensorType(("T", 512)),) * 2, (None, None), (TensorType(("T", 512)),)), ZEN4),
    "attention": (_attention(None), ZEN4),
}
# knobs that only matter given others: the values that make them matter
CONTEXT = {"strided_tiles": {"tiles_per_task": 2}, "prefetch_locality": {"prefetch_bytes": 4096, "prefetch": 1}}


def _probes(rule, knob) -> list[int]:
    """The largest choice of `knob` other than the request's default that the rule takes there (one probe per
    knob keeps the assembly builds in bounds; the hypothesis test runs the others)."""
    req, preset = REQUESTS[rule.name]
    base = {**rule.default_knobs(req, preset), **{k: v for k, v in CONTEXT.get(knob.name, {}).items() if k in
                                                   {kk.name for kk in rule.knobs}}}
    ok = []
    for c in knob.choices:
        if c == base[knob.name]:
            continue
        try:
            rule.resolve_knobs(req, preset, {**base, knob.name: c})
        except ValueError:
            continue
        ok.append(c)
    return [max(ok)] if ok else []


CASES = [(rule, knob) for rule in RULES for knob in rule.knobs]


@functools.lru_cache(maxsize=None)
def _asm_of(name: str, knobs: tuple) -> str:
    req, preset = REQUESTS[name]
    built, func = build_request(req, dict(knobs), preset)
    assert built.name == name
    return asm(func, preset)


def _asm(rule, knobs) -> str:
    return _asm_of(rule.name, tuple(sorted(knobs.items())))


def test_every_rule_with_knobs_has_a_request():
    assert {r.name for r in RULES if r.knobs} <= set(REQUESTS)


def test_requests_select_their_rule():
    for name, (req, preset) in REQUESTS.items():
        assert select_rule(req, preset).name == name


@pytest.mark.parametrize("rule,knob", CASES, ids=lambda x: getattr(x, "name", str(x)))
def test_knob_changes_generated_code(rule, knob):
    """The largest other choice the rule takes against the request's default (with the knobs
    it depends on set so that it matters: CONTEXT). The hypothesis test (test_space_numerics.py) runs
    random points of every space against float64 references."""
    req, preset = REQUESTS[rule.name]
    default = rule.default_knobs(req, preset)
    assert knob.default in knob.choices and default[knob.name] in knob.choices
    probes = _probes(rule, knob)
    assert probes, f"no other choice of {knob.name} fits the request"
    base = {k: v for k, v in CONTEXT.get(knob.name, {}).items() if k in default}
    ref = _asm(rule, {**base, knob.name: default[knob.name]})
    for c in probes:
        assert _asm(rule, {**base, knob.name: c}) != ref, (knob.name, c)


def test_unknown_knob_is_rejected():
    req, preset = REQUESTS["gemv"]
    rule = select_rule(req, preset)
    with pytest.raises(ValueError, match="no knob"):
        rule.resolve_knobs(req, preset, {"tile_q": 3})


def test_attention_input_passes_split_heads_into_half_tiles():
    """A pass accumulates a run of whole half tiles (8 rows); passes that split a head otherwise are refused
    (the tuner leaves them out), and 256-bit targets default to one row tile per pass."""
    from kernels import candidates
    from ellm.schedules.attention_input import passes_fit

    assert passes_fit(64, 8) and passes_fit(128, 8) and passes_fit(80, 2) and passes_fit(96, 4)
    assert not passes_fit(80, 4) and not passes_fit(64, 3)
    req, preset = REQUESTS["attention_input"]
    rule = select_rule(req, preset)
    hd = PLAN.head_dim
    assert all(passes_fit(hd, c["passes"]) for c in candidates(rule, req, preset, 100))
    assert rule.default_knobs(req, V3)["passes"] == hd // 16
    assert rule.default_knobs(req, SPR)["passes"] == 1


def test_quantised_keys_score_with_vpdpbusd():
    """Decode attention over q8 keys: the 16 scores of a tile come from vpdpbusd (twice: the int8 halves of
    the 16-bit query) on key codes transposed by vpermb (4 channels of a key per 32-bit lane); with the knob
    off, from float FMAs only (values in float too here, so no vpdpbusd is left)."""
    rule = select_rule(*REQUESTS["attention_decode"])
    asm = _asm(rule, {"int_values": 0})
    assert "vpdpbusd" in asm and "vpermb" in asm
    assert "vpdpbusd" not in _asm(rule, {"int_scores": 0, "int_values": 0})


def test_quantised_values_sum_with_vpdpbusd():
    """Decode attention over q4 values (keys scored in float): with int_values the weighted sum of a block's
    value codes is vpdpbusd over groups of 4 keys, the q4 codes split by mask and shift; with it off, float
    FMAs of dequantised codes only."""
    rule = select_rule(*REQUESTS["attention_decode"])
    assert "vpdpbusd" in _asm(rule, {"int_scores": 0})
    assert "vpdpbusd" not in _asm(rule, {"int_scores": 0, "int_values": 0})


def test_decode_prefetches_blocks_ahead():
    """With the prefetch knob on, decode issues prefetcht1 for the stored block ahead in its read list and
    for the next widening candidate: one per 64-byte line of a block's key and value codes and params
    (q8 K: 4 KiB + 256 B, q4 V: 2 KiB + 256 B); with it off, none."""
    rule = select_rule(*REQUESTS["attention_decode"])
    lines = (64 * 64 + 256 + 64 * 32 + 256) // 64
    assert _asm(rule, {}).count("prefetcht1") >= lines
    assert "prefetcht1" not in _asm(rule, {"prefetch": 0})
