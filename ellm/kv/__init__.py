"""The KV cache: per-layer precision plan, block layout and tiers (see docs/kv-cache-design.md)."""

from .plan import KV_TYPE_NAMES, KVPlan, KVType, StateTensor

__all__ = ["KV_TYPE_NAMES", "KVPlan", "KVType", "StateTensor"]
