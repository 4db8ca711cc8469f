"""Public import path of COD attention; the op lives in peagle_ext.ops.attention."""

from .ops.attention import CodAttentionMetadata, cod_attention, cod_attention_metadata

__all__ = ["CodAttentionMetadata", "cod_attention", "cod_attention_metadata"]
