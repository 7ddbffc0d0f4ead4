"""Helpers to build and run single kernels in tests."""

from __future__ import annotations

import numpy as np
import tvm

from ellm.compiler.graph import OpKind, TensorType
from ellm.schedules import KernelRequest, select_rule  # noqa: F401  (re-exported for tests)
from ellm.targets import get_preset

PRESET = get_preset("znver4")
TARGET = PRESET.tvm_target()


def build(func):
    return tvm.compile(func, target=TARGET)


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


def build_request(req, knobs=None):
    """(rule, kernel) as lowering builds it: the selected rule, then the prefetch-injection pass."""
    from ellm.schedules.inject_prefetch import inject_prefetch

    rule = select_rule(req, PRESET)
    return rule, inject_prefetch(rule.build(req, PRESET, rule.resolve_knobs(req, PRESET, knobs)))
