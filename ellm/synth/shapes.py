"""Model shapes people run, as typed hyper-parameters (the published configurations of the Llama 3 family)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import EllmError


@dataclass(frozen=True)
class ModelShape:
    name: str
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    d_ff: int
    vocab: int
    tied: bool  # the output head is the token embedding
    rope_base: float = 500000.0
    ctx: int = 8192  # context_length written to the GGUF (the shape of no weight; engines size caches from it)

    def __post_init__(self) -> None:
        if min(self.n_layers, self.d_model, self.n_heads, self.n_kv_heads, self.head_dim, self.d_ff, self.vocab) < 1:
            raise ValueError(f"{self.name}: every dimension must be positive")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"{self.name}: n_heads must be a multiple of n_kv_heads")
        if self.vocab < 512:
            raise ValueError(f"{self.name}: the synthetic vocabulary needs at least 512 tokens")

    @property
    def n_params(self) -> int:
        attn = self.d_model * self.head_dim * (2 * self.n_heads + 2 * self.n_kv_heads)
        ffn = 3 * self.d_model * self.d_ff
        embd = self.vocab * self.d_model * (1 if self.tied else 2)
        return self.n_layers * (attn + ffn + 2 * self.d_model) + embd + self.d_model


SHAPES: dict[str, ModelShape] = {
    s.name: s
    for s in (
        # Llama 3.2 1B: tied embeddings
        ModelShape("llama-1b", 16, 2048, 32, 8, 64, 8192, 128256, tied=True),
        # Llama 3.2 3B: tied embeddings
        ModelShape("llama-3b", 28, 3072, 24, 8, 128, 8192, 128256, tied=True),
        # Llama 3.1 8B
        ModelShape("llama-8b", 32, 4096, 32, 8, 128, 14336, 128256, tied=False),
    )
}


def get_shape(name: str) -> ModelShape:
    try:
        return SHAPES[name]
    except KeyError:
        raise EllmError(f"unknown model shape {name!r} (known: {', '.join(SHAPES)})") from None
