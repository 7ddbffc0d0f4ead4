"""The bandwidth bound of `ellm bench`: a buffer that misses the last-level cache, and a kernel that reads all of it."""

from __future__ import annotations

import pytest

from ellm.bench.bandwidth import buffer_mb, measure_read_bandwidth


@pytest.mark.parametrize("llc, mb", [(0, 512), (32 << 20, 512), (300 << 20, 1200), (480 << 20, 1920), ((480 << 20) + 1, 1924)])
def test_buffer_is_four_times_the_llc(llc, mb):
    assert buffer_mb(llc) == mb


def test_read_kernel_reads_the_whole_buffer():
    # measure_read_bandwidth checks the kernel's sum of ones against the element count
    bw = measure_read_bandwidth(threads=2, size_mb=8, repeats=2)
    assert bw.bytes == 8 << 20
    assert 0 < bw.gb_s_min <= bw.gb_s_median <= bw.gb_s_max
    assert bw.prefetch_bytes in (0, 2048, 8192)
