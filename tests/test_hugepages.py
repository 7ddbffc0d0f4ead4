"""Weights and KV state on transparent huge pages (runtime/hugepages.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ellm.runtime.hugepages import HUGE, huge_arrays, huge_bytes

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _anon_huge_kb(addr: int) -> int:
    """AnonHugePages of the mapping of this process that contains addr."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    inside = False
    for line in lines:
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def test_arrays_are_aligned_disjoint_and_writable():
    specs = [((3, 5), "float16"), ((1000, 577), "uint8"), ((7,), "float32"), ((2, 300_000), "int32")]
    arrays = huge_arrays(specs)
    assert arrays[0].ctypes.data % HUGE == 0
    for a, (shape, dtype) in zip(arrays, specs):
        assert a.shape == shape and a.dtype == np.dtype(dtype) and a.flags.c_contiguous
        assert a.ctypes.data % 64 == 0
    spans = sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    for i, a in enumerate(arrays):
        a[...] = i + 1
    assert all((a == i + 1).all() for i, a in enumerate(arrays))


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages here")
def test_memory_is_on_huge_pages():
    a = huge_bytes(8 * HUGE)
    a[:] = 1  # fault it in
    assert _anon_huge_kb(a.ctypes.data) >= 2048
