"""Precision from measurement: per-part sensitivity of a model's output, and plans that spend bytes where they matter."""

from .levels import quant_level_plan
from .plan import Budget, HeadSplit, PrecisionPlan, WeightInfo, candidates, weight_infos

__all__ = ["Budget", "HeadSplit", "PrecisionPlan", "WeightInfo", "candidates", "quant_level_plan", "weight_infos"]
