"""A tensor-parallel rank as a Disco worker: `python -m ellm.parallel.worker` is the entry point Disco starts for
workers 1..N-1; imported by the driver, the same functions serve worker 0, a thread of the driver.

Every function here catches what it raises: an exception escaping on worker 0 aborts the driver, and one on
another worker kills it silently. A failure is recorded in the group's segment (ccl.Communicator.fail), which
stops every rank's collectives at once, and in the worker's state, which the driver reads after each call.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from . import ccl

OPEN, STEP, CLOSE = "ellm.parallel.open", "ellm.parallel.step", "ellm.parallel.close"


@dataclass
class RankState:
    rank: int
    engine: Any = None  # runtime.engine.Engine on this rank's artifact
    comm: ccl.Communicator | None = None
    logits: np.ndarray | None = None  # the last step's logits (the driver reads worker 0's)
    error: str | None = None


# The workers of this process by rank: worker 0 lives in the driver's process, and this is how the driver reads
# its results without a round trip through Disco.
_states: dict[int, RankState] = {}
_lock = threading.Lock()


def state(rank: int) -> RankState | None:
    return _states.get(rank)


def _rank() -> int:
    import tvm_ffi

    return int(tvm_ffi.get_global_func("runtime.disco.worker_rank")())


def _guarded(fn):
    def run(*args):
        st = _states.get(_rank()) or RankState(_rank())
        try:
            fn(st, *args)
        except BaseException as e:  # noqa: BLE001 (see the module docstring)
            st.error = st.error or f"rank {st.rank}: {e}"
            if st.comm is not None:
                st.comm.fail(str(e))
        with _lock:
            _states[st.rank] = st

    return run


def _open(st: RankState, group_dir: str, segment: str, slot_bytes: int, timeout_s: float, cpus: str,
          ctx_size: int) -> None:
    """Map the group's segment and load this rank's artifact on its CPUs (`cpus`: one comma-separated list per
    rank, joined by ';')."""
    from ..numa.placement import NumaOptions
    from ..runtime.engine import Engine
    from .build import read_group

    group = read_group(Path(group_dir))
    st.comm = ccl.Communicator(segment, st.rank, group.world, slot_bytes, timeout_s)
    ccl.attach(st.comm)
    mine = tuple(int(c) for c in cpus.split(";")[st.rank].split(","))
    numa = NumaOptions(mode="isolate", cpus=mine)
    st.engine = Engine.load(group.rank_dir(st.rank), ctx_size=ctx_size or None, numa=numa, threads=len(mine))


def _step(st: RankState, kind: str, ids, n: int) -> None:
    """`kind`: "prefill" (ids), "decode" (ids[0]), "truncate" (to n tokens)."""
    if st.engine is None:
        raise RuntimeError("the rank has no model (open failed)")
    e = st.engine
    if kind == "prefill":
        st.logits = e.prefill([int(i) for i in ids])
    elif kind == "decode":
        st.logits = e.decode(int(ids[0]))
    elif kind == "truncate":
        e.truncate(n)
    else:
        raise ValueError(f"unknown step {kind!r}")


def _close(st: RankState) -> None:
    st.engine = None
    ccl.attach(None)


def register() -> None:
    """The functions a worker runs (and the collectives its VM calls)."""
    import tvm_ffi

    ccl.register()
    tvm_ffi.register_global_func(OPEN, _guarded(_open), override=True)
    tvm_ffi.register_global_func(STEP, _guarded(_step), override=True)
    tvm_ffi.register_global_func(CLOSE, _guarded(_close), override=True)


def main() -> None:
    from .disco import disco_module

    disco_module()
    register()
    from tvm.exec.disco_worker import main as disco_main

    try:
        disco_main()
    except (OSError, KeyboardInterrupt):
        pass


if __name__ == "__main__":
    main()
