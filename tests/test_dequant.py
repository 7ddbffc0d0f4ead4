"""Packing + TIR dequantisation of every supported type is bit-exact with gguf.quants.dequantize."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGMLQuantizationType as G
from gguf.quants import dequantize
from kernels import build, run
from quantizers import quantize

from ellm.quant import FORMATS, QuantType, pack_rows
from ellm.schedules.dequant import dequant_kernel

ALL = list(FORMATS)


def _kernel_dequant(raw: np.ndarray, qtype: QuantType) -> np.ndarray:
    rows = raw.shape[0]
    fmt = FORMATS[qtype]
    cols = raw.shape[1] // fmt.block_bytes * fmt.block
    comps = pack_rows(raw, qtype)
    ex = build(dequant_kernel(fmt, rows, cols))
    out = run(ex, *[comps[c.name] for c in fmt.components], np.zeros((rows, cols), np.float32))
    return out[-1].numpy()


def _assert_bit_exact(got: np.ndarray, ref: np.ndarray) -> None:
    ref = ref.astype(np.float32)
    same = (got.view(np.uint32) == ref.view(np.uint32)) | (np.isnan(got) & np.isnan(ref))
    assert same.all(), f"{(~same).sum()} of {same.size} values differ"


def _random_blocks(qtype: QuantType, rows: int, cols: int, rng) -> np.ndarray:
    """Arbitrary bytes: every bit pattern of quants, scales and mins (including inf/nan scales)."""
    return rng.integers(0, 256, (rows, FORMATS[qtype].row_bytes(cols)), dtype=np.uint8)


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_random_blocks_bit_exact(qtype):
    rng = np.random.default_rng(int(qtype))
    raw = _random_blocks(qtype, 16, 512, rng)
    with np.errstate(invalid="ignore", over="ignore"):
        ref = dequantize(raw, G(int(qtype))).reshape(16, 512)
    _assert_bit_exact(_kernel_dequant(raw, qtype), ref)


@pytest.mark.parametrize("qtype", ALL, ids=lambda q: q.name)
def test_real_weights_bit_exact(qtype, reference):
    """Real tensors: the model's own Q4_1/Q8_0 bytes, and its weights requantised into the other types."""
    from gguf import GGUFReader

    from ellm.models import default_model_path

    r = GGUFReader(default_model_path())
    tensors = {t.name: t for t in r.tensors}
    if qtype in (QuantType.Q4_1, QuantType.Q8_0):
        name = "blk.3.ffn_up.weight" if qtype is QuantType.Q4_1 else "token_embd.weight"
        raw = np.asarray(tensors[name].data)[:256]
    else:
        w = reference.w["blk.3.ffn_up.weight"][:256].astype(np.float32)  # [256, 576] -> 512 columns (K-quant blocks)
        raw = quantize(w[:, :512], int(qtype))
    ref = dequantize(raw, G(int(qtype))).reshape(raw.shape[0], -1)
    _assert_bit_exact(_kernel_dequant(raw, qtype), ref)


def test_pack_is_lossless_byte_count():
    """Components hold exactly the GGUF bytes (Q4_K's 12 packed scale bytes widen to 16)."""
    from ellm.quant import packed_nbytes

    for q, fmt in FORMATS.items():
        extra = 4 * (512 // 256) if q is QuantType.Q4_K else 0
        assert packed_nbytes(q, 1, 512) == fmt.row_bytes(512) + extra
