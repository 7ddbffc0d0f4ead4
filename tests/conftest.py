"""Shared fixtures: the default model, one compiled artifact per session, the float64 reference."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))
sys.path.insert(0, str(Path(__file__).parent))

THREADS = min(2, os.cpu_count() or 1)


@pytest.fixture(scope="module", autouse=True)
def _forget_built_kernels():
    """Kernels built by one test module (kernels.build) are not kept for the next: loaded modules hold on to
    the arguments of their first call."""
    yield
    from kernels import BUILT

    BUILT.clear()


@pytest.fixture(scope="session")
def model_path() -> Path:
    from ellm.models import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def artifact(tmp_path_factory, model_path) -> Path:
    from ellm.compiler.build import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("artifacts") / "smollm2"
    # a float16 cache, so the float64 reference (K/V rounded through float16) checks it; the default (auto)
    # plan is checked against this artifact in test_kv_quant_model.py. 16-bit activations in chunks too, so
    # teacher-forced logits meet the int16 bounds (the default's 8-bit chunks: test_matmul_precision_bounds)
    compile_model(model_path, out, CompileOptions(target="auto", cache_type_k="f16", cache_type_v="f16", activations="int16"))
    return out


@pytest.fixture(scope="session")
def artifact_f32_int16(tmp_path_factory, model_path) -> Path:
    """SmolLM2 with a float32 cache and 16-bit activations (precision bounds, eval against dense)."""
    from ellm.compiler.build import CompileOptions, compile_model

    out = tmp_path_factory.mktemp("artifacts") / "smollm2-f32-int16"
    compile_model(model_path, out, CompileOptions(target="auto", cache_type_k="f32", cache_type_v="f32", activations="int16"))
    return out


@pytest.fixture(scope="session")
def engine(artifact):
    import ellm

    return ellm.load(artifact, threads=THREADS, ctx_size=2048)


@pytest.fixture(scope="session")
def reference(model_path):
    """The float64 model with K and V rounded through float16, as the engine's default cache stores them."""
    from reference import NumpyLlama

    return NumpyLlama(model_path, kv_dtype="float16")


@pytest.fixture(scope="session")
def real_text() -> str:
    """A long real English text that every install has: the Apache License 2.0 shipped with apache-tvm."""
    import tvm

    return (Path(tvm.__file__).parent / "LICENSE").read_text()


@pytest.fixture(scope="session")
def real_ids(engine, real_text) -> list[int]:
    ids = engine.tokenizer.encode(real_text)
    assert len(ids) >= 1000
    return ids
