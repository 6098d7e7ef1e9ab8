"""Pick the paged-attention implementation: the compiled kernels when the selected variant has them, else torch."""

from __future__ import annotations

import torch

from .. import ops
from . import torch_paged
from .metadata import AttentionMetadata

_KERNELS = hasattr(ops, "paged_attention") and hasattr(ops, "reshape_and_cache")
KERNEL_HEAD_SIZES = (64, 80, 96, 128, 256)  # what ops.paged_attention is compiled for; block_size % 16 == 0


def uses_kernels(head_size: int = 128, block_size: int = 16) -> bool:
    """True when attention with this head size / block size runs on the compiled kernels (else torch)."""
    return _KERNELS and head_size in KERNEL_HEAD_SIZES and block_size % 16 == 0


def reshape_and_cache(
    key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, meta: AttentionMetadata
) -> None:
    """Store this step's key/value [T, kv_heads, head_size] in one layer's cache."""
    if uses_kernels(key_cache.shape[3], key_cache.shape[2]):
        ops.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)
    else:
        torch_paged.reshape_and_cache(key, value, key_cache, value_cache, meta.slot_mapping)


def paged_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int = 0,
    soft_cap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> None:
    """out[T, q_heads, hs] = attention of query [T, q_heads, hs] over one layer's paged cache (sinks: a float32
    logit per query head joining each row's softmax sum, or None)."""
    if uses_kernels(key_cache.shape[3], key_cache.shape[2]):
        ops.paged_attention(
            out,
            query,
            key_cache,
            value_cache,
            meta.query_start_loc,
            meta.seq_lens,
            meta.block_tables,
            scale,
            sliding_window,
            soft_cap,
            sinks,
        )
    else:
        torch_paged.paged_attention(out, query, key_cache, value_cache, meta, scale, sliding_window, soft_cap, sinks)
