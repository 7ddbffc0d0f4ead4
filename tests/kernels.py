"""Helpers to build and run single kernels in tests.

Kernel tests run for the host's best target (`PRESET`). `ELLM_CPU_MASK` narrows what the host counts as
having, so `ELLM_CPU_MASK='avx512*,amx*,avx_vnni' make test` runs the suite as an AVX2-only CPU would.
Code for other targets is checked in its assembly and never run: `runnable(preset)` says which may run.
"""

from __future__ import annotations

import numpy as np
import pytest
import tvm
import tvm_ffi

from ellm.compiler.graph import OpKind, TensorType
from ellm.compiler.tir_pipeline import compile_tir
from ellm.schedules import KernelRequest, select_rule  # noqa: F401  (re-exported for tests)
from ellm.targets import IsaClass, detect_host, get_preset, preset_for_host

HOST = detect_host()
PRESET = preset_for_host(HOST)
TARGET = PRESET.tvm_target()

# One preset per ISA class; a class's kernels run where the host can run its preset.
ISA_PRESETS = {
    IsaClass.AVX2: get_preset("x86-64-v3"),
    IsaClass.AVX_VNNI: get_preset("alderlake"),
    IsaClass.AVX512_VNNI: get_preset("znver4"),
    IsaClass.AMX: get_preset("sapphirerapids"),
}


def runnable(preset) -> bool:
    return HOST.can_run(preset)


def needs(preset):
    """Skip a test that runs `preset`'s code on a host that lacks its features."""
    return pytest.mark.skipif(not runnable(preset), reason=f"this CPU cannot run {preset.name} code ({preset.isa.label})")


def isa_params(*classes: IsaClass):
    """pytest params over ISA classes (each skipped where the host cannot run it), ids by class."""
    return [pytest.param(ISA_PRESETS[c], id=c.name.lower(), marks=needs(ISA_PRESETS[c])) for c in classes]


# (structural hash, preset, pass options) -> (PrimFunc, executable): a kernel several tests of a module build
# (the same GEMM at four token counts, a default beside each knob) is compiled once; emptied after each module
BUILT: dict = {}


def build(func, preset=None):
    """`func` compiled for `preset` (default: the host's), through the same pipeline as compile."""
    preset = preset or PRESET
    ctx = tvm.transform.PassContext.current()
    if list(ctx.instruments):  # a test watching the passes run must see them run
        return compile_tir(func, preset)
    key = (tvm_ffi.structural_hash(func), preset.name, ctx.opt_level, str(dict(ctx.config)))
    hit = BUILT.get(key)
    if hit is not None and tvm_ffi.structural_equal(hit[0], func):
        return hit[1]
    ex = compile_tir(func, preset)
    BUILT[key] = (func, ex)
    return ex


def asm(func, preset) -> str:
    """The assembly of `func` compiled for `preset` (any preset: nothing runs)."""
    return build(func, preset).mod.inspect_source("asm")


def run(ex, *arrays, scalars=(), name="main"):
    """Call a compiled kernel with NumPy arrays (copied into aligned TVM tensors); returns the TVM tensors."""
    tensors = [tvm.runtime.tensor(np.ascontiguousarray(a)) for a in arrays]
    ex[name](*tensors, *scalars)
    return tensors


def matmul_request(
    qtype, n, k, m=None, norm=False, bias=False, residual=False, last_row=False, kind=OpKind.MATMUL, layout="rows", act_bits=None
):
    attrs = {"layout": layout}
    if act_bits:
        attrs["act_bits"] = act_bits
    if norm:
        attrs["norm_eps"] = 1e-5
    if residual:
        attrs["residual"] = True
    if last_row:
        attrs["last_row"] = True
    vectors = (("norm",) if norm else ()) + (("bias",) if bias else ())
    return KernelRequest(
        kind, m, (TensorType(("T", k)),), (None,), (TensorType(("T", n)),), qtype, (n, k), vectors, tuple(sorted(attrs.items()))
    )


def build_request(req, knobs=None, preset=None):
    """(rule, kernel) as lowering builds it: the selected rule, then the prefetch-injection pass."""
    preset = preset or PRESET
    rule = select_rule(req, preset)
    return rule, rule.build_kernel(req, preset, rule.resolve_knobs(req, preset, knobs))


def candidates(rule, req, target, budget: int, seed: int = 0) -> list[dict]:
    """The default, then distinct random points of the rule's speed-search space: `budget` in all."""
    from ellm.autotune import STRATEGIES

    space = rule.space(req, target)
    s = STRATEGIES["random"](space, seed)
    s.observe([(space.default, None)])
    return [space.default] + s.propose(budget - 1)

