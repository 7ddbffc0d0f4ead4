"""`ellm synth`: llama GGUF files of real shapes (1B, 3B, 8B) with random weights and llama.cpp's type mixes,
for speed measurements at the model sizes people run (speed does not depend on the weights' values)."""

from .shapes import SHAPES, ModelShape, get_shape
from .type_mix import TYPE_MIXES, TypeMix, get_type_mix, use_more_bits
from .writer import tensor_plan, write_synthetic

__all__ = ["SHAPES", "TYPE_MIXES", "ModelShape", "TypeMix", "get_shape", "get_type_mix", "tensor_plan", "use_more_bits",
           "write_synthetic"]
