"""Tensor types per role and layer, as llama.cpp's quantizer assigns them (src/llama-quant.cpp), so a synthetic
file has the bytes per step of the real one."""

from __future__ import annotations

from dataclasses import dataclass

from gguf import GGMLQuantizationType as G

from ..errors import EllmError


def use_more_bits(i_layer: int, n_layers: int) -> bool:
    """llama.cpp's choice of the layers that get more bits: the first and last eighths and every third between."""
    return i_layer < n_layers // 8 or i_layer >= 7 * n_layers // 8 or (i_layer - n_layers // 8) % 3 == 2


@dataclass(frozen=True)
class TypeMix:
    name: str
    base: G  # every matmul weight not named below
    output: G  # the output head (or the tied embedding)
    more_bits: G | None = None  # attn_v and ffn_down in use_more_bits layers
    file_type: int = 0  # general.file_type (llama_ftype)

    def tensor_type(self, role: str, layer: int, n_layers: int, tied: bool) -> G:
        """Type of a weight: role is token_embd, output, or a block tensor name (attn_q, ..., ffn_down)."""
        if role == "output" or (role == "token_embd" and tied):
            return self.output
        if role in ("attn_v", "ffn_down") and self.more_bits is not None and use_more_bits(layer, n_layers):
            return self.more_bits
        return self.base


TYPE_MIXES: dict[str, TypeMix] = {
    m.name: m
    for m in (
        TypeMix("q4_k_m", G.Q4_K, G.Q6_K, G.Q6_K, file_type=15),  # LLAMA_FTYPE_MOSTLY_Q4_K_M
        TypeMix("q4_0", G.Q4_0, G.Q6_K, file_type=2),
        TypeMix("q4_1", G.Q4_1, G.Q6_K, file_type=3),
        TypeMix("q8_0", G.Q8_0, G.Q8_0, file_type=7),
    )
}


def get_type_mix(name: str) -> TypeMix:
    try:
        return TYPE_MIXES[name]
    except KeyError:
        raise EllmError(f"unknown type mix {name!r} (known: {', '.join(TYPE_MIXES)})") from None
