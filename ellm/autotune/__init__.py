"""Per-CPU-model schedule search and tuning databases.

The pieces, each replaceable: a rule's `Space` (schedules/space.py), a `Strategy` (strategies.py) proposing
points, a `CostModel` (cost_model.py) for model-guided search, a builder (builder.py: parallel worker
processes) and a runner (runner.py: check against the default, then time with measure.py), tied together
by `search_kernel` and `tune_model` (tuner.py); every trial lands in a `TuningDatabase` (database.py).
A `Landscape` (replay.py) stands in for builder and runner to replay a search on times a sweep measured.
"""

import importlib

# name -> the module defining it, imported at first use (PEP 562): every `ellm` command builds the `tune`
# parser, which lives in this package, and should not import TVM for it
_WHERE = {
    "Constraint": "..schedules.space", "Knob": "..schedules.space", "Space": "..schedules.space",
    "BuildJob": ".builder", "Built": ".builder", "LocalBuilder": ".builder", "CostModel": ".cost_model",
    "TuningDatabase": ".database", "TuningLookup": ".database", "TuningRecord": ".database",
    "Landscape": ".replay", "best_so_far": ".replay", "RPCRunner": ".rpc", "LocalRunner": ".runner", "Trial": ".runner",
    "STRATEGIES": ".strategies", "EvolutionarySearch": ".strategies", "GridSearch": ".strategies",
    "ModelSearch": ".strategies", "RandomSearch": ".strategies", "Strategy": ".strategies",
    "KernelSearch": ".tuner", "TuneOptions": ".tuner", "search_kernel": ".tuner", "tune_model": ".tuner",
}


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_WHERE[name], __name__), name)
    globals()[name] = value
    return value


__all__ = sorted(_WHERE)
