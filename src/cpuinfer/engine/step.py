"""One step's schedule as the model runner sees it: one typed record per scheduled sequence.

A shared leaf module (CONTRIBUTING.md): the scheduler builds these records, and the model runner, the tensor-
parallel workers, pipeline stages and the draft proposer read them. Importing it loads neither the models nor
the kernels, so the scheduler stays cheap to load and to test."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ScheduledSeq:
    """One sequence's share of a step: what it computes, where its KV lives, and which logits it wants back."""

    token_ids: list[int]  # tokens to compute this step (a prefill chunk, or 1 for decode), proposals last
    start_pos: int  # tokens of this sequence already in the KV cache (= position of token_ids[0])
    block_table: list[int]  # physical block ids covering positions [0, start_pos + len(token_ids))
    sample: bool  # True -> return logits for the last token of this chunk
    num_spec: int = 0  # the last num_spec tokens are proposals to verify: return the last num_spec + 1 rows
    # True -> return logits for every token of this chunk (prompt logprobs); the last is the sample row.
    prompt_logits: bool = False
    token_type_ids: list[int] | None = None  # an encoder's segment id of each token (a cross-encoder pair's)

    @property
    def num_tokens(self) -> int:
        """Tokens this sequence computes this step (its proposals included)."""
        return len(self.token_ids)

    @property
    def logit_rows(self) -> int:
        """How many rows of the step's logits are this sequence's (always its last rows)."""
        if self.prompt_logits:
            return len(self.token_ids)
        return 1 + self.num_spec if self.sample else 0
