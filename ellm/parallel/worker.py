"""A tensor-parallel rank as a Disco worker: `python -m ellm.parallel.worker` is the entry point Disco starts for
workers 1..N-1; imported by the driver, the same functions serve worker 0, a thread of the driver.

Every function here catches what it raises: an exception escaping on worker 0 aborts the driver, and one on
another worker kills it silently. A failure is recorded in the group's segment (ccl.Communicator.fail), which
stops every rank's collectives at once, and in the worker's state, which the driver reads after each call.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from . import ccl

OPEN, STEP, CLOSE = "ellm.parallel.open", "ellm.parallel.step", "ellm.parallel.close"


@dataclass
class RankState:
    group: str  # the driver's name for the group (several may run from one driver)
    rank: int
    engine: Any = None  # runtime.engine.Engine on this rank's artifact
    comm: ccl.Communicator | None = None
    logits: np.ndarray | None = None  # the last step's logits (the driver reads worker 0's)
    error: str | None = None


# The workers of this process by (group, rank): worker 0 of each group lives in the driver's process, and this
# is how the driver reads its results without a round trip through Disco.
_states: dict[tuple[str, int], RankState] = {}
_lock = threading.Lock()


def state(group: str, rank: int) -> RankState | None:
    return _states.get((group, rank))


def _rank() -> int:
    import tvm_ffi

    return int(tvm_ffi.get_global_func("runtime.disco.worker_rank")())


def _guarded(fn):
    def run(group: str, *args):
        st = None
        try:
            rank = _rank()
            st = _states.get((group, rank)) or RankState(group, rank)
            ccl.attach(st.comm)
            fn(st, *args)
        except BaseException as e:  # noqa: BLE001 (see the module docstring)
            if st is not None:
                st.error = st.error or f"rank {st.rank}: {e}"
                if st.comm is not None:
                    st.comm.fail(str(e))
        if st is not None:
            with _lock:
                _states[(group, st.rank)] = st

    return run


def _open(st: RankState, group_dir: str, transport: str, slot_bytes: int, timeout_s: float, cpus: str,
          ctx_size: int) -> None:
    """Join the group's transport (ccl.connect) and load this rank's artifact on its CPUs (`cpus`: one
    comma-separated list per rank, joined by ';')."""
    from ..numa.placement import NumaOptions
    from ..runtime.engine import Engine
    from .build import read_group

    group = read_group(Path(group_dir))
    st.comm = ccl.connect(transport, st.rank, group.world, slot_bytes, timeout_s)
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
    """Drop the model; the transport stays until the process ends (the driver still reads worker 0's)."""
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
