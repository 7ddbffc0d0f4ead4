"""Graph -> graph passes. Each lives in its own file, named for what it does."""

from .apply_precision_plan import apply_precision_plan
from .choose_weight_layout import choose_weight_layout
from .fuse_attention_input import fuse_attention_input
from .fuse_ffn import fuse_ffn
from .fuse_residual_add import fuse_residual_add
from .fuse_rmsnorm_matmul import fuse_rmsnorm_matmul
from .fuse_rope_kv_append import fuse_rope_kv_append
from .fuse_sibling_matmuls import fuse_sibling_matmuls
from .plan_kv_cache import plan_kv_cache
from .plan_numa_layout import plan_numa_layout
from .shard_tensor_parallel import shard_tensor_parallel
from .split_vocab_head import split_vocab_head

__all__ = ["apply_precision_plan", "choose_weight_layout", "fuse_attention_input", "fuse_ffn", "fuse_residual_add", "fuse_rmsnorm_matmul", "fuse_rope_kv_append", "fuse_sibling_matmuls", "plan_kv_cache", "plan_numa_layout", "shard_tensor_parallel", "split_vocab_head"]
