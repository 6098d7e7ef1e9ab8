"""Quantized weights: the kernels' quantized layout and the checkpoint formats rewritten into it."""

from .weight import QuantStack, QuantWeight, concat, is_quantized

__all__ = ["QuantStack", "QuantWeight", "concat", "is_quantized"]
