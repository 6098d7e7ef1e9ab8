"""The vectorized bitmask application against a plain per-token reference."""

from __future__ import annotations

import torch

from cpuinfer.structured.bitmask import allocate_bitmask, apply_bitmask_


def reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for j, r in enumerate(rows):
        for t in range(logits.shape[1]):
            word = int(bitmask[j, t // 32]) if t // 32 < bitmask.shape[1] else 0
            if not (word >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


def test_bits_map_to_tokens_for_all_rows_and_for_some_rows():
    g = torch.Generator().manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word is partly padding
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, 4), dtype=torch.int32, generator=g)
    bitmask[0, 0] = -1  # all of the first 32 allowed, bit 31 (the sign bit) included
    logits = torch.randn(3, vocab, generator=g)
    whole = logits.clone()
    apply_bitmask_(whole, bitmask)
    assert torch.equal(whole, reference(logits, bitmask, [0, 1, 2]))
    some = logits.clone()
    apply_bitmask_(some, bitmask[:2], rows=[2, 0])
    assert torch.equal(some, reference(logits, bitmask[:2], [2, 0]))


def test_ids_past_the_bitmask_are_blocked_and_an_all_allowed_mask_changes_nothing():
    logits = torch.randn(1, 70)
    narrow = allocate_bitmask(1, 64)
    apply_bitmask_(logits, narrow)
    assert torch.isinf(logits[0, 64:]).all() and torch.isfinite(logits[0, :64]).all()
