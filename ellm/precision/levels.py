"""`--quant-level 0|1|2`: the fixed precision recipes users know, each capped at the source types.

  0  everything at its highest precision: weights as the GGUF stores them, a float16 KV cache, 16-bit
     activations;
  1  attention at 8 bits (Q/K/V/O weights and the output head at Q8_0, the KV cache q8), the FFN at 4 bits;
  2  everything at 4 bits: weights, head and KV cache.

"4 bits" is the first of Q4_K, Q4_1, Q4_0 whose blocks fit the row (K-quants need rows of 256), so a row of
576 gets Q4_1. A source already at or below a level's width stays as it is: a Q4_1 model's attention at
level 1 remains Q4_1, and the plan's notes say so.
"""

from __future__ import annotations

from ..errors import EllmError
from ..kv.plan import KVType
from ..quant import QuantType
from .plan import PrecisionPlan, WeightInfo, bits

FOUR_BIT = (QuantType.Q4_K, QuantType.Q4_1, QuantType.Q4_0)
LEVELS = (0, 1, 2)


def _at_width(info: WeightInfo, width: int) -> QuantType:
    """`info`'s type at a nominal width of 8 or 4 bits: never above its source."""
    wanted = [QuantType.Q8_0] if width == 8 else list(FOUR_BIT)
    if bits(info.source) <= max(bits(t) for t in wanted):
        return info.source  # already at (or below) the width
    cands = info.candidates()
    for t in wanted:
        if t in cands:
            return t
    return info.source  # no block of that width fits its rows


def quant_level_plan(level: int, infos: list[WeightInfo], n_layers: int) -> PrecisionPlan:
    if level not in LEVELS:
        raise EllmError(f"--quant-level must be 0, 1 or 2, got {level}")
    if level == 0:
        kv, act = KVType.F16, "int16"
    elif level == 1:
        kv, act = KVType.Q8, None
    else:
        kv, act = KVType.Q4, "int8"
    weights, capped = [], []
    if level > 0:
        for info in infos:
            width = 8 if level == 1 and info.part in ("q", "k", "v", "o", "head") else 4
            t = _at_width(info, width)
            if t is not info.source:
                weights.append((info.name, t))
            elif bits(info.source) < bits(QuantType.Q8_0 if width == 8 else QuantType.Q4_0):
                capped.append(info.name)
    notes = ()
    if capped:
        notes = (f"{len(capped)} weights stay at their source type, below the level's width (a plan never raises a "
                 f"tensor above its source): {_names(capped)}",)
    return PrecisionPlan(tuple(weights), (kv,) * n_layers, (kv,) * n_layers, act, f"quant-level {level}", notes)


def _names(names: list[str], most: int = 4) -> str:
    shown = ", ".join(names[:most])
    return shown + (f" and {len(names) - most} more" if len(names) > most else "")
