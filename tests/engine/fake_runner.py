"""A stand-in model for engine tests: its 'KV cache' stores token ids, and its logits are a pure function of the
whole context it reads back through the block table. So any block-table, prefix-cache or preemption bug changes
the output, and the reference is the same function applied to the plain token list."""

from __future__ import annotations

import zlib

import torch

VOCAB = 97


def reference_logits(context: list[int]) -> torch.Tensor:
    """Logits after `context` (independent of any cache)."""
    seed = zlib.crc32(torch.tensor(context, dtype=torch.int64).numpy().tobytes())
    g = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, generator=g) * 3


def reference_greedy(prompt: list[int], n: int, stop: set[int] = frozenset()) -> list[int]:
    """Greedy continuation of `prompt` by the fake model."""
    ctx, out = list(prompt), []
    for _ in range(n):
        t = int(reference_logits(ctx).argmax())
        out.append(t)
        ctx.append(t)
        if t in stop:
            break
    return out


class FakeRunner:
    """Implements ModelRunner.execute over a token-id cache."""

    def __init__(self, num_blocks: int, block_size: int):
        self.cache = torch.full((num_blocks, block_size), -1, dtype=torch.int64)
        self.block_size = block_size
        self.steps: list[list[tuple[int, int, bool]]] = []  # per step: (start_pos, len, sample)

    def execute(self, seqs) -> torch.Tensor:
        bs = self.block_size
        rows = []
        self.steps.append([(s.start_pos, len(s.token_ids), s.sample) for s in seqs])
        for s in seqs:
            end = s.start_pos + len(s.token_ids)
            assert len(s.block_table) * bs >= end, "block table too short"
            for j, t in enumerate(s.token_ids):
                p = s.start_pos + j
                self.cache[s.block_table[p // bs], p % bs] = t
            if s.logit_rows:
                ctx = [int(self.cache[s.block_table[p // bs], p % bs]) for p in range(end)]
                assert -1 not in ctx, "read an unwritten slot"
                # Its last logit_rows rows: one to sample, num_spec + 1 to verify proposals, or every row.
                for j in range(s.logit_rows - 1, -1, -1):
                    rows.append(reference_logits(ctx[: end - j]))
        return torch.stack(rows) if rows else torch.empty(0, VOCAB)
