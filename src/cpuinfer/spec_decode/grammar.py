"""Speculation under a grammar (structured output): proposals are cut to what the grammar accepts before they
are verified, and each verification row is masked by the grammar's state after the proposals before it, so a
constrained sequence samples each token exactly as plain decoding would."""

from __future__ import annotations

import torch

from cpuinfer.structured.backend import GrammarState
from cpuinfer.structured.bitmask import allocate_bitmask, apply_bitmask_
from cpuinfer.structured.manager import StructuredOutputManager


def grammar_prefix(state: GrammarState, drafts: list[int]) -> list[int]:
    """The leading proposals the grammar accepts in a row (none once it is complete)."""
    if not drafts or state.is_terminated():
        return []
    return drafts[: state.valid_prefix(drafts)]


def mask_rows(manager: StructuredOutputManager, state: GrammarState, drafts: list[int], logits: torch.Tensor) -> None:
    """In place on logits [len(drafts) + 1, V]: row j masked by what the grammar allows after drafts[:j] (the
    state is walked through the drafts and rolled back)."""
    bitmask = allocate_bitmask(len(drafts) + 1, manager.vocab_size)
    walked = 0
    for j in range(len(drafts) + 1):
        manager.backend.fill_bitmask([state], bitmask[j : j + 1])
        if j == len(drafts) or not state.accept(drafts[j]):
            break  # proposals were cut to the grammar's prefix: a refusal here leaves the later rows all-allowed
        walked += 1
    state.rollback(walked)
    apply_bitmask_(logits, bitmask)


def advance(state: GrammarState, token_ids: list[int]) -> int | None:
    """Feed a step's new tokens to the grammar; the first token it refuses, or None."""
    for t in token_ids:
        if not state.accept(t):
            return t
    return None
