"""TVM's TIR lowering pipeline for CPU kernels, without the buffer compaction our block-free kernels spend most of
their build in; every kernel eLLM compiles goes through `compile_tir`.

CompactBufferAllocation shrinks each buffer to the region its accesses touch. The kernels written with the
IRBuilder (integer GEMV/GEMM, attention, attention_input, FFN, RoPE, AMX) have no blocks and allocate exactly
what they touch, so on them the pass only restates what is there (index offsets of zero; for buffers sized by
the dynamic token count, a longer expression equal to the declared size), yet its region analysis took 2.3 s
of a 4.4 s pipeline for SmolLM2's decode attention and 14 s of a 55 s model compile. Here it runs only on
functions whose body is a root block (TE-scheduled kernels), where it does its work. The assembly of every
rule's kernel, and of the whole SmolLM2 library, is byte-identical to TVM's default pipeline
(tests/test_tir_pipeline.py). A future block-free kernel that over-allocates would keep its declared size:
memory, not correctness.

The pass list is TVM 0.27's `tvm.s_tir.pipeline.default_s_tir_pipeline`, in its order, with its
configuration switches (the test compares the passes run under each switch).
"""

from __future__ import annotations

NAME = "ellm_cpu"


def compact_block_buffers():
    """CompactBufferAllocation on the PrimFuncs whose body is a root block; the rest pass through."""
    import tvm
    from tvm import s_tir, tirx

    @tvm.transform.module_pass(opt_level=0, name="ellm.CompactBlockBufferAllocation")
    def _compact(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        blocks = [gv for gv, f in mod.functions_items()
                  if isinstance(f, tirx.PrimFunc) and isinstance(f.body, s_tir.SBlockRealize)]
        if not blocks:
            return mod
        compacted = s_tir.transform.CompactBufferAllocation()(tvm.IRModule({gv: mod[gv] for gv in blocks}))
        out = mod.clone()
        for gv in blocks:
            out.update_func(gv, compacted[gv.name_hint])
        return out

    return _compact


def _pipeline_factory():
    import tvm
    from tvm import s_tir, tirx
    from tvm.s_tir.pipeline import finalize_device_passes, finalize_host_passes

    @tvm.transform.module_pass(opt_level=0, name="ellm.tir_pipeline")
    def _pipeline(mod: tvm.ir.IRModule, _ctx) -> tvm.ir.IRModule:
        config = tvm.transform.PassContext.current().config
        passes = [
            s_tir.transform.CanonicalizeLoop(),
            s_tir.transform.LowerCrossThreadReduction(),
            s_tir.transform.LowerInitBlock(),
            s_tir.transform.PlanAndUpdateBufferAllocationLocation(),
            s_tir.transform.ConvertBlocksToOpaque(),
            s_tir.transform.LiftThreadBinding(),
            s_tir.transform.ManifestSharedMemoryLocalStage(),
            compact_block_buffers(),  # TVM: CompactBufferAllocation() on every function
            s_tir.transform.LowerAutoCopy(),
            s_tir.transform.UnifyThreadBinding(),
            s_tir.transform.LowerMatchBuffer(),
            s_tir.transform.StmtSimplify(),
            s_tir.transform.InjectPermutedLayout(),
            s_tir.transform.AnnotateIrregularLoop(),
            s_tir.transform.InjectSoftwarePipeline(),
            s_tir.transform.TransformMmaBufferLayout(),
            s_tir.transform.LowerOpaqueBlock(),
            tirx.transform.FlattenBuffer(),
            tirx.transform.BF16ComputeLegalize(),
            tirx.transform.NarrowDataType(32),
            s_tir.transform.LoopPartition(),
            tirx.transform.VectorizeLoop(not bool(config.get("tirx.disable_vectorize", False))),
            s_tir.transform.InjectVirtualThread(),
            s_tir.transform.InjectDoubleBuffer(),
        ]
        if not bool(config.get("tirx.disable_storage_rewrite", False)):
            passes.append(tirx.transform.StorageRewrite())
        if config.get("tirx.use_async_copy", False):
            passes.append(s_tir.transform.LowerAsyncDMA())
        passes += [
            s_tir.transform.HoistIfThenElse(),
            tirx.transform.UnrollLoop(),
            s_tir.transform.RenormalizeSplitPattern(),
            tirx.transform.StmtSimplify(),
            tirx.transform.RemoveNoOp(),
            s_tir.transform.RewriteUnsafeSelect(),
        ]
        if bool(config.get("tirx.instrument_bound_checkers", False)):
            passes.append(s_tir.transform.InstrumentBoundCheckers())
        if bool(config.get("tirx.s_tir.ldg32", False)):
            passes.append(s_tir.transform.InjectPTXLDG32(True))
        if not bool(config.get("tirx.disable_cse_tir", False)):
            passes.append(tirx.transform.CommonSubexprElim())
        if bool(config.get("tirx.instrument_lwp", False)):
            passes.append(s_tir.transform.InstrumentProfileIntrinsics())
        passes += [
            tirx.transform.FP8ComputeLegalize(),
            s_tir.transform.VerifyVTCMLimit(),
            s_tir.transform.LowerVtcmAlloc(),
            tirx.transform.VerifyMemory(),
            tirx.transform.AnnotateEntryFunc(),
            s_tir.transform.ThreadSync("shared"),
            s_tir.transform.ThreadSync("shared.dyn"),
            s_tir.transform.ThreadSync("warp"),
            s_tir.transform.InferFragment(),
            s_tir.transform.LowerThreadAllreduce(),
        ]
        if bool(config.get("tirx.use_async_copy", False)):
            passes.append(s_tir.transform.InjectPTXAsyncCopy())
        if bool(config.get("tirx.s_tir.ldg32", False)):
            passes.append(s_tir.transform.InjectPTXLDG32())
        passes += [
            s_tir.transform.MergeSharedMemoryAllocations(),
            tirx.transform.SplitHostDevice(),
            tirx.transform.MakePackedAPI(),
            tirx.transform.FP8StorageLegalize(),
            tirx.transform.BF16StorageLegalize(),
        ]
        return tvm.ir.transform.Sequential(passes)(mod)

    return _pipeline, finalize_host_passes, finalize_device_passes


def register() -> str:
    """Register the pipeline with TVM (idempotent) and return its name, for `tvm.compile(..., tir_pipeline=)`."""
    from tvm.tirx.compilation_pipeline import register_tir_pipeline

    register_tir_pipeline(NAME, _pipeline_factory)
    return NAME


def compile_tir(mod, preset, **kwargs):
    """`tvm.compile` of a PrimFunc or IRModule for a target preset, through this pipeline."""
    import tvm

    return tvm.compile(mod, target=preset.tvm_target(), tir_pipeline=register(), **kwargs)


__all__ = ["NAME", "compact_block_buffers", "compile_tir", "register"]
