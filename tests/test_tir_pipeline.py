"""eLLM's TIR pipeline is TVM's default one, minus buffer compaction where there are no blocks: the same passes in
the same order, and the same assembly for every rule's kernel."""

from __future__ import annotations

import pytest
import tvm
from kernels import build_request
from test_schedule_knobs import REQUESTS

from ellm.compiler.tir_pipeline import compile_tir

TVM_COMPACT, OURS_COMPACT = "s_tir.CompactBufferAllocation", "ellm.CompactBlockBufferAllocation"


@tvm.instrument.pass_instrument
class _Names:
    def __init__(self):
        self.names: list[str] = []

    def run_before_pass(self, mod, info):
        self.names.append(info.name)


def _passes(func, preset, ours: bool, config=None) -> list[str]:
    rec = _Names()
    with tvm.transform.PassContext(opt_level=3, instruments=[rec], config=config or {}):
        if ours:
            compile_tir(func, preset)
        else:
            tvm.compile(func, target=preset.tvm_target())
    return rec.names


def _strip(asm: str) -> str:
    return "\n".join(line for line in asm.splitlines() if not line.strip().startswith((".file", ".ident", "#")))


SWITCHES = [{}, {"tirx.disable_vectorize": True}, {"tirx.disable_storage_rewrite": True},
            {"tirx.instrument_bound_checkers": True}, {"tirx.disable_cse_tir": True}]


@pytest.mark.parametrize("config", SWITCHES, ids=lambda c: next(iter(c), "default"))
@pytest.mark.parametrize("name", ["vnni_gemv", "rmsnorm"])
def test_pass_list_is_tvms(name, config):
    """vnni_gemv is written with the IRBuilder (no blocks: compaction skipped), rmsnorm with TE (compacted)."""
    req, preset = REQUESTS[name]
    _, func = build_request(req, None, preset)
    theirs, ours = _passes(func, preset, False, config), _passes(func, preset, True, config)
    assert theirs.count(TVM_COMPACT) == 1 and ours.count(OURS_COMPACT) == 1
    blocks = name == "rmsnorm"
    assert ours.count(TVM_COMPACT) == int(blocks)
    rename = {OURS_COMPACT: TVM_COMPACT, "ellm.tir_pipeline": "_pipeline"}  # TVM's pipeline pass is `_pipeline`
    assert [rename.get(n, n) for n in ours if n != TVM_COMPACT] == theirs and len(theirs) > 40


@pytest.mark.parametrize("name", sorted(REQUESTS))
def test_same_assembly_as_tvms_pipeline(name):
    req, preset = REQUESTS[name]
    _, func = build_request(req, None, preset)
    theirs = tvm.compile(func, target=preset.tvm_target()).mod.inspect_source("asm")
    ours = compile_tir(func, preset).mod.inspect_source("asm")
    assert _strip(ours) == _strip(theirs)
