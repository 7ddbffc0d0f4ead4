"""The cost of verifying k drafted tokens against a one-token decode step, measured once per artifact,
machine and thread count (at the context where speculation first runs) and kept in the cache directory."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..fsutil import atomic_write_text

if TYPE_CHECKING:
    from ..runtime.engine import Engine

VERSION = 1
POINTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 31)  # drafted tokens measured; the rest interpolated
ROUNDS = 5


def step_times(eng: Engine, ks, rounds: int = ROUNDS, token: int | None = None) -> dict[int, float]:
    """Median seconds of a decode step (k = 0) and of verification steps of k drafted tokens (k + 1 rows),
    each run at the engine's current position and rolled back; rounds alternate over all k, so slow
    phases of a shared machine fall on every k alike. The first round warms up and is not counted."""
    n = eng.n_cached
    tok = int(token or 0)  # any token: a step's cost does not depend on which
    ks = [0, *[k for k in ks if k > 0]]
    if n + max(ks) + 1 > eng.ctx_size:
        raise ValueError("no room in the context for the measurement")
    times: dict[int, list[float]] = {k: [] for k in ks}
    for r in range(rounds + 1):
        for k in ks:
            t = time.perf_counter()
            if k == 0:
                eng.decode(tok)
            else:
                eng.verify([tok] * (k + 1))
            dt = time.perf_counter() - t
            eng.truncate(n)
            if r:
                times[k].append(dt)
    return {k: float(np.median(v)) for k, v in times.items()}


def curve_from(times: dict[int, float], max_chain: int) -> list[float]:
    """Cost ratios for k = 0 .. max_chain, interpolated between the measured k."""
    ks = sorted(times)
    ratios = [times[k] / times[0] for k in ks]
    return [1.0] + [float(np.interp(k, ks, ratios)) for k in range(1, max_chain + 1)]


def _path(cache: Path, eng: Engine) -> Path:
    from ..targets import detect_host

    host = re.sub(r"[^A-Za-z0-9.-]+", "_", detect_host().identity).strip("_")
    return cache / "verify-cost" / f"{eng.artifact.identity}-{host}-t{eng.threads}.json"


def load_or_measure(eng: Engine, cache: Path, max_verify: int) -> list[float]:
    """The artifact's cost curve on this machine for k = 0 .. max_verify - 1: from the cache, or measured
    now at the engine's position (about 50 steps) and saved."""
    path = _path(cache, eng)
    max_chain = max_verify - 1
    try:
        rec = json.loads(path.read_text())
        if rec.get("version") == VERSION and len(rec["curve"]) == max_chain + 1:
            return [float(x) for x in rec["curve"]]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    room = min(max_chain, eng.ctx_size - eng.n_cached - 1)
    ks = [k for k in POINTS if k <= room]
    if not ks:  # no room for a verification step: the controller will only ever decode
        return [1.0] + [float("inf")] * max_chain
    times = step_times(eng, ks)
    curve = curve_from(times, max_chain)
    if room < max_chain:  # measured in part: used, not kept
        return curve
    rec = {"version": VERSION, "artifact": eng.artifact.identity, "threads": eng.threads, "ctx": eng.n_cached,
           "seconds": {str(k): v for k, v in times.items()}, "curve": curve}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps(rec, indent=1))
    except OSError:
        pass  # a read-only cache: measured again next time
    return curve
