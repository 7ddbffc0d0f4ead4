"""Weight formats: GGUF tensor types and the packed component layout eLLM's kernels read."""

from .formats import FORMATS, QuantType, WeightFormat, format_of
from .pack import pack_rows, packed_nbytes

__all__ = ["FORMATS", "QuantType", "WeightFormat", "format_of", "pack_rows", "packed_nbytes"]
