"""The block summaries are exact upper bounds: for any keys and query, no key of a block scores above the
bound the sparse selection ranks that block by (schedules/sparse_select.py), for every KV precision."""

from __future__ import annotations

import functools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ellm.kv.plan import KVPlan, KVType
from kernels import build, build_request
from kvcache import empty_state, layer_args, stored_block
from test_kv_cache import _requests

HKV, G, HD, NB = 2, 3, 64, 3  # [NB, 64] keys per KV head


def _bounds_kernel(plan: KVPlan, kt: KVType, vt: KVType):
    """out[h, i] = block_bounds of block i for KV head h and the G query heads of q [HKV * G * HD]."""
    from tvm.script.ir_builder import IRBuilder
    from tvm.tirx.script.builder import ir as I

    from ellm.schedules.kv_blocks import KVBuffers
    from ellm.schedules.sparse_select import block_bounds

    with IRBuilder() as ib:
        with I.prim_func():
            I.func_name("bounds")
            kv = KVBuffers.declare(plan, kt, vt)
            q = I.arg("q", I.buffer((HKV * G * HD,), "float32"))
            out = I.arg("out", I.buffer((HKV * NB,), "float32"))
            with I.serial(0, HKV) as h:
                qs = I.alloc_buffer((G * HD,), "float32")
                with I.serial(0, G * HD) as i:
                    I.buffer_store(qs, q[h * G * HD + i], [i])
                block_bounds(kv, qs, G, h, 0, 0, NB, out, h * NB)
    return ib.get()


@functools.lru_cache(maxsize=None)
def _kernels(kt: KVType):
    plan = KVPlan.uniform(1, HKV, HD, kt, KVType.F16, max_chunk=64)
    append_req = _requests(plan, HKV * G, 0)[0]
    f_app = build(build_request(append_req)[1])["kv_append"]
    f_bounds = build(_bounds_kernel(plan, kt, KVType.F16))["bounds"]
    return plan, f_app, f_bounds


finite = st.floats(-1e3, 1e3, allow_nan=False, width=32)


@pytest.mark.parametrize("kt", [KVType.F16, KVType.Q8, KVType.Q4])
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), key_scale=finite, q_scale=st.floats(1e-3, 1e2), outlier=finite,
       const_channel=st.booleans())
def test_block_bounds_are_upper_bounds(kt, seed, key_scale, q_scale, outlier, const_channel):
    import tvm

    plan, f_app, f_bounds = _kernels(kt)
    rng = np.random.default_rng(seed)
    n = NB * plan.block
    k = (rng.standard_normal((HKV, n, HD)) * key_scale).astype(np.float32)
    k[:, rng.integers(0, n), rng.integers(0, HD)] = outlier  # one extreme value per head
    if const_channel:
        k[:, :, rng.integers(0, HD)] = key_scale  # a channel with zero range (scale 0)
    v = rng.standard_normal((HKV, n, HD)).astype(np.float32)
    state = [tvm.runtime.tensor(a) for a in empty_state(plan, n + 4 * plan.block)]
    args = layer_args(plan, 0, state)
    for pos in range(0, n + 3 * plan.block, plan.block):  # push the last of the NB blocks out of the ring
        kk = k[:, pos : pos + 64] if pos < n else np.zeros((HKV, 64, HD), np.float32)
        vv = v[:, pos : pos + 64] if pos < n else np.zeros((HKV, 64, HD), np.float32)
        f_app(*args, tvm.runtime.tensor(np.ascontiguousarray(kk.transpose(1, 0, 2).reshape(64, -1))),
              tvm.runtime.tensor(np.ascontiguousarray(vv.transpose(1, 0, 2).reshape(64, -1))), pos, 0, 0, 0)
    q = (rng.standard_normal(HKV * G * HD) * q_scale).astype(np.float32)
    out = tvm.runtime.tensor(np.zeros(HKV * NB, np.float32))
    f_bounds(*args, tvm.runtime.tensor(q), out)
    bounds = out.numpy().reshape(HKV, NB)
    by_name = {s.name: t.numpy() for s, t in zip(plan.state_tensors(), state)}
    for h in range(HKV):
        qh = q[h * G * HD : (h + 1) * G * HD].astype(np.float64).reshape(G, HD)
        for b in range(NB):
            keys = stored_block(plan, 0, by_name, h, b)[0].astype(np.float64)  # [B, HD] as attention reads them
            best = (keys @ qh.T).max()  # the largest score of any key in the block, any query head
            # float32 accumulation in the kernel: allow rounding relative to the terms' magnitude
            slack = 1e-5 * (np.abs(keys).max() * np.abs(qh).sum(1).max() + 1e-30)
            assert best <= bounds[h, b] + slack, (h, b, best, bounds[h, b])
