"""Public import path of COD sampling; the op lives in peagle_ext.ops.cod."""

from .ops.cod import MAX_DEPTHS, CodLayout, cod_sample

__all__ = ["MAX_DEPTHS", "CodLayout", "cod_sample"]
