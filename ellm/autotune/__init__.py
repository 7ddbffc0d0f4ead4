"""Per-CPU-model schedule search and tuning databases.

The pieces, each replaceable: a rule's `Space` (schedules/space.py), a `Strategy` (strategies.py) proposing
points, a `CostModel` (cost_model.py) for model-guided search, a builder (builder.py: parallel worker
processes) and a runner (runner.py: check against the default, then time with measure.py), tied together
by `search_kernel` and `tune_model` (tuner.py); every trial lands in a `TuningDatabase` (database.py).
A `Landscape` (replay.py) stands in for builder and runner to replay a search on times a sweep measured.
"""

from ..schedules.space import Constraint, Knob, Space
from .builder import BuildJob, Built, LocalBuilder
from .cost_model import CostModel
from .database import TuningDatabase, TuningLookup, TuningRecord
from .replay import Landscape, best_so_far
from .rpc import RPCRunner
from .runner import LocalRunner, Trial
from .strategies import STRATEGIES, EvolutionarySearch, GridSearch, ModelSearch, RandomSearch, Strategy
from .tuner import KernelSearch, TuneOptions, search_kernel, tune_model

__all__ = [
    "STRATEGIES", "BuildJob", "Built", "Constraint", "CostModel", "EvolutionarySearch", "GridSearch", "KernelSearch", "Knob",
    "Landscape", "LocalBuilder", "LocalRunner", "ModelSearch", "RPCRunner", "RandomSearch", "Space", "Strategy", "Trial", "TuneOptions",
    "TuningDatabase", "TuningLookup", "TuningRecord", "best_so_far", "search_kernel", "tune_model",
]
