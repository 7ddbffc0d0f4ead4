"""eLLM: a TVM compiler and runtime for long-context, batch-1 LLM inference on CPU servers."""

from __future__ import annotations

import os

__version__ = "0.1.0"

# TVM sizes its worker pool once, at the first parallel kernel, and defaults to half the logical CPUs.
# Let it hold every CPU; each engine then selects how many it uses (runtime.threads.set_threads).
os.environ.setdefault("TVM_NUM_THREADS", str(os.cpu_count() or 1))


def load(path, threads: int | None = None, ctx_size: int | None = None, **options):
    """Load a compiled artifact directory into an inference engine (options: see runtime.engine.Engine)."""
    from .runtime.engine import Engine

    return Engine.load(path, threads=threads, ctx_size=ctx_size, **options)


__all__ = ["__version__", "load"]
