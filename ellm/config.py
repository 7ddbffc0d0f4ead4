"""Model hyper-parameters: one frozen, validated config built from GGUF metadata in exactly one place."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import Any

from .errors import EllmError, GGUFError

SUPPORTED_ARCHITECTURES = ("llama", "qwen2")


ROPE_SCALINGS = ("none", "linear", "yarn")


@dataclass(frozen=True)
class RopeScaling:
    """RoPE position scaling, to run a model past the context it was trained on.

    `linear`: positions divided by `factor`. `yarn` (Peng et al. 2023, as llama.cpp computes it):
    frequency pairs that turn fewer than `beta_slow` times over `original_ctx` are interpolated
    (divided by `factor`), those that turn more than `beta_fast` times are kept, with a linear ramp
    between; cos and sin are multiplied by attn_factor * (1 + 0.1 ln factor).
    """

    kind: str = "none"
    factor: float = 1.0
    original_ctx: int = 0  # the trained context the ramp is measured against (0: the model's ctx_train)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attn_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in ROPE_SCALINGS:
            raise GGUFError(f"unsupported RoPE scaling type {self.kind!r} (supported: {', '.join(ROPE_SCALINGS)})")
        if not self.factor > 0:
            raise GGUFError(f"RoPE scaling factor must be positive, got {self.factor}")
        if self.original_ctx < 0 or not self.beta_fast > self.beta_slow > 0 or not self.attn_factor > 0:
            raise GGUFError("RoPE scaling: bad original context, beta_fast/beta_slow or attn_factor")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a llama-family decoder."""

    arch: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab_size: int
    ctx_train: int
    rms_eps: float
    rope_base: float
    rope_dim: int
    rope_neox: bool  # rotate (i, i + rope_dim/2) pairs; False rotates adjacent (2i, 2i+1) pairs
    rope_scaling: RopeScaling
    rope_freq_factors: tuple[float, ...]  # per-pair divisors of the RoPE frequencies (llama 3.1), or ()
    attn_bias: bool  # Q, K, V projections carry a bias (qwen2)
    tied_embeddings: bool  # the LM head reuses token_embd.weight

    def __post_init__(self) -> None:
        for f in ("n_layers", "d_model", "n_heads", "n_kv_heads", "head_dim", "d_ff", "vocab_size", "ctx_train"):
            v = getattr(self, f)
            if not isinstance(v, int) or v <= 0:
                raise GGUFError(f"model config: {f} must be a positive integer, got {v!r}")
        if self.arch not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(
                f"unsupported architecture {self.arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
            )
        if self.n_heads % self.n_kv_heads:
            raise GGUFError(f"model config: {self.n_heads} heads is not a multiple of {self.n_kv_heads} KV heads")
        if self.head_dim % 2 or self.rope_dim % 2 or not 0 < self.rope_dim <= self.head_dim:
            raise GGUFError(f"model config: bad head_dim {self.head_dim} / rope_dim {self.rope_dim}")
        if not self.rms_eps > 0 or not self.rope_base > 0:
            raise GGUFError("model config: rms_eps and rope_base must be positive")
        if self.rope_freq_factors and len(self.rope_freq_factors) != self.rope_dim // 2:
            raise GGUFError(
                f"model config: {len(self.rope_freq_factors)} RoPE frequency factors for {self.rope_dim // 2} pairs"
            )

    # --- derived sizes -------------------------------------------------------------------
    @property
    def q_dim(self) -> int:
        return self.n_heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def group_size(self) -> int:
        return self.n_heads // self.n_kv_heads

    def kv_bytes_per_token(self, kv_itemsize: int) -> int:
        """Bytes of K and V cache written per token over all layers."""
        return 2 * self.n_layers * self.kv_dim * kv_itemsize

    def with_rope_scaling(self, kind: str, factor: float) -> ModelConfig:
        """This config with the user's RoPE scaling instead of the GGUF's (`ellm run --rope-scaling`)."""
        if kind == "none":
            return replace(self, rope_scaling=RopeScaling())
        original = self.rope_scaling.original_ctx or self.ctx_train
        return replace(self, rope_scaling=RopeScaling(kind=kind, factor=float(factor), original_ctx=original))

    def first_layers(self, n: int) -> ModelConfig:
        """The first `n` layers of this model and its head: a self-draft (`ellm compile --draft-layers`)."""
        if not 1 <= n < self.n_layers:
            raise EllmError(f"--draft-layers must be between 1 and {self.n_layers - 1} (the model has {self.n_layers} layers), got {n}")
        return replace(self, n_layers=n)

    # --- (de)serialisation for the artifact manifest --------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["rope_scaling"] = RopeScaling(**d["rope_scaling"])
        d["rope_freq_factors"] = tuple(d.get("rope_freq_factors", ()))
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_gguf(cls, gf) -> ModelConfig:
        """The one place GGUF metadata becomes hyper-parameters."""
        arch = gf.get_str("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(f"unsupported architecture {arch!r} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        a = f"{arch}."

        # sizes are positive before anything divides by them; typed getters name a key of the wrong type
        d_model = gf.get_int(a + "embedding_length", minimum=1)
        n_heads = gf.get_int(a + "attention.head_count", minimum=1)
        n_kv = gf.get_int(a + "attention.head_count_kv", n_heads, minimum=1)
        head_dim = gf.get_int(a + "attention.key_length", d_model // n_heads, minimum=1)
        if gf.get_int(a + "attention.value_length", head_dim) != head_dim:
            raise GGUFError("unsupported model: key and value head sizes differ")
        if not gf.has("token_embd.weight"):
            raise GGUFError(f"{gf.path}: tensor token_embd.weight is missing")
        vocab = gf.get_int(a + "vocab_size", 0, minimum=0) or gf.info("token_embd.weight").rows

        scaling_type = gf.get_str(a + "rope.scaling.type", "none")
        scaling = RopeScaling(
            kind=scaling_type,
            factor=gf.get_float(a + "rope.scaling.factor", 1.0) if scaling_type != "none" else 1.0,
            original_ctx=gf.get_int(a + "rope.scaling.original_context_length", 0, minimum=0),
            beta_fast=gf.get_float(a + "rope.scaling.yarn_beta_fast", 32.0),
            beta_slow=gf.get_float(a + "rope.scaling.yarn_beta_slow", 1.0),
            attn_factor=gf.get_float(a + "rope.scaling.attn_factor", 1.0),
        )
        return cls(
            arch=arch,
            n_layers=gf.get_int(a + "block_count", minimum=1),
            d_model=d_model,
            n_heads=n_heads,
            n_kv_heads=n_kv,
            head_dim=head_dim,
            d_ff=gf.get_int(a + "feed_forward_length", minimum=1),
            vocab_size=vocab,
            ctx_train=gf.get_int(a + "context_length", minimum=1),
            rms_eps=gf.get_float(a + "attention.layer_norm_rms_epsilon", positive=True),
            rope_base=gf.get_float(a + "rope.freq_base", 10000.0, positive=True),
            rope_dim=gf.get_int(a + "rope.dimension_count", head_dim, minimum=1),
            rope_neox=arch == "qwen2",
            rope_scaling=scaling,
            rope_freq_factors=tuple(float(x) for x in gf.vector("rope_freqs.weight")) if gf.has("rope_freqs.weight") else (),
            attn_bias=arch == "qwen2",
            tied_embeddings=not gf.has("output.weight"),
        )
