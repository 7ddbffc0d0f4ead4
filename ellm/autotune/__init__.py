"""Per-CPU-model schedule search and tuning databases."""

from .database import TuningDatabase, TuningRecord

__all__ = ["TuningDatabase", "TuningRecord"]
