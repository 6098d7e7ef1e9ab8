"""The flat per-step batch description every attention layer reads (built once per step)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and which cached keys each query sees.

    Query token j of sequence s has position seq_lens[s] - qlen_s + j and attends to keys
    p <= position (and position - p < window on sliding-window layers).
    """

    slot_mapping: torch.Tensor  # [T] int64: block * block_size + offset; < 0 skips the write
    query_start_loc: torch.Tensor  # [S+1] int32
    seq_lens: torch.Tensor  # [S] int32: context length including this step
    block_tables: torch.Tensor  # [S, max_blocks] int32
    block_size: int
    query_lens: list[int]  # python copies, so the torch path does not sync on tensors
    context_lens: list[int]
    max_query_len: int
    # Per-step caches for the torch path (masks per window), filled lazily and dropped with the step.
    _torch_cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        """Number of sequences in the step."""
        return len(self.query_lens)
