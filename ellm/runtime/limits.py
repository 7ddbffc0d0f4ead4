"""What a context costs before any of it is allocated: a context that does not fit in the memory available is
refused up front with the bytes it needs, and one beyond the trained length without RoPE scaling is warned
about, naming the option that extends it."""

from __future__ import annotations

from typing import Callable

from ..config import ModelConfig
from ..errors import EllmError
from ..kv.plan import KVPlan

# the RoPE table is computed in float64 ([ctx, rope_dim/2] positions times frequencies, cos and sin) and kept
# as float32 [ctx, rope_dim]: at its peak about this many bytes a position and rope dimension
ROPE_BYTES = 8 * 2 + 4


def context_size(ctx_size: int | None, ctx_train: int) -> int:
    """The context an engine allocates: `ctx_size` (at least 1), or the trained context where it is None."""
    if ctx_size is not None and int(ctx_size) < 1:  # None, not 0, means the trained context
        raise EllmError(f"ctx_size must be at least 1, got {ctx_size}")
    return int(ctx_size if ctx_size is not None else ctx_train)


def context_bytes(cfg: ModelConfig, kv: KVPlan, ctx: int) -> dict[str, int]:
    """Bytes a context of `ctx` tokens allocates: the KV state and the RoPE table (at its peak)."""
    return {"kv": kv.nbytes(ctx), "rope": ctx * cfg.rope_dim * ROPE_BYTES}


def check_context(cfg: ModelConfig, kv: KVPlan, ctx: int, weights_bytes: int, available: int | None,
                  log: Callable[[str], None]) -> None:
    """Refuse a context whose KV state, RoPE table and private weight copy exceed 90% of `available` bytes;
    warn once for a context past the trained one without RoPE scaling."""
    parts = context_bytes(cfg, kv, ctx)
    need = sum(parts.values()) + weights_bytes
    if available is not None and need > 0.9 * available:
        raise EllmError(f"a context of {ctx} tokens needs {need / 2**30:.2f} GiB (KV cache {parts['kv'] / 2**30:.2f}, "
                        f"RoPE table {parts['rope'] / 2**30:.2f}, weights {weights_bytes / 2**30:.2f}), but "
                        f"{available / 2**30:.2f} GiB is available: use a smaller --ctx-size")
    if ctx > cfg.ctx_train and cfg.rope_scaling.kind == "none":
        log(f"warning: a context of {ctx} tokens is past the {cfg.ctx_train} the model was trained on, without RoPE "
            "scaling: text past that length degrades (--rope-scaling yarn --rope-scale F extends it)")
