"""Paged attention over the KV cache: step metadata, the torch reference path and the kernel dispatch."""

from .backend import paged_attention, reshape_and_cache, uses_kernels
from .metadata import AttentionMetadata

__all__ = ["AttentionMetadata", "paged_attention", "reshape_and_cache", "uses_kernels"]
