"""Random, valid GGUF blocks of each tensor type: random quants, scales chosen so the dequantised weights have
a standard deviation near 0.02 (as trained LLM weights do) and every value is a finite normal float."""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType as G
from gguf.constants import GGML_QUANT_SIZES

STD = 0.02


def _f16(x: np.ndarray) -> np.ndarray:
    """float16 bytes of x, [n, 2] uint8."""
    return x.astype(np.float16).view(np.uint8).reshape(-1, 2)


def random_blocks(qtype: G, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """[rows, row_bytes] uint8 of `rows` x `cols` weights of `qtype` (cols a multiple of the block size)."""
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    nb = rows * cols // block
    raw = rng.integers(0, 256, (nb, block_bytes), dtype=np.uint8)
    jitter = rng.uniform(0.7, 1.3, nb)
    if qtype is G.Q4_0:  # w = d (q - 8): sd(q - 8) = 4.61
        raw[:, 0:2] = _f16(STD / 4.61 * jitter)
    elif qtype is G.Q4_1:  # w = d q + m
        d = STD / 4.61 * jitter
        raw[:, 0:2] = _f16(d)
        raw[:, 2:4] = _f16(-7.5 * d)
    elif qtype is G.Q8_0:  # w = d q, q in [-127, 127]: sd 73.3
        raw[:, 0:2] = _f16(STD / 73.3 * jitter)
        raw[:, 2:] = rng.integers(-127, 128, (nb, 32), dtype=np.int8).view(np.uint8)
    elif qtype is G.Q4_K:  # w = d sc q - dmin mn, 6-bit sc and mn: sd(sc q) ~ 202, mean 236 = 7.5 * mean(mn)
        d = STD / 202.0 * jitter
        raw[:, 0:2] = _f16(d)
        raw[:, 2:4] = _f16(7.5 * d)
    elif qtype is G.Q6_K:  # w = d sc (q - 32), int8 sc drawn from [-24, 24]: sd(sc (q - 32)) ~ 260
        raw[:, 192:208] = rng.integers(-24, 25, (nb, 16), dtype=np.int8).view(np.uint8)
        raw[:, 208:210] = _f16(STD / 260.0 * jitter)
    else:
        raise ValueError(f"no random blocks for {qtype.name}")
    return raw.reshape(rows, cols // block * block_bytes)


def row_bytes(qtype: G, cols: int) -> int:
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    return cols // block * block_bytes
