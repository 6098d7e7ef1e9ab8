"""The engine core's state of one sequence: its tokens, how many are in the KV cache, and its blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from cpuinfer.engine.block_pool import block_hash
from cpuinfer.sampling_params import SamplingParams
from cpuinfer.structured.backend import GrammarState


class Status(enum.Enum):
    """Where a request is in its life."""

    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(eq=False)
class Request:
    """One sequence inside the engine core (a request with n > 1 becomes n of these)."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: int  # admission order; the newest running request is preempted first
    max_tokens: int  # resolved: params.max_tokens or what fits the context
    eos_token_ids: frozenset[int] = frozenset()
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of full blocks of all_token_ids
    num_cached_blocks: int = 0  # leading blocks registered in the prefix cache
    num_prefix_hit_tokens: int = 0
    num_preemptions: int = 0
    status: Status = Status.WAITING
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    generator: torch.Generator | None = None
    # Stop tokens masked until min_tokens are out (eos unless ignore_eos, plus stop_token_ids).
    stop_ids: tuple[int, ...] = ()
    # Where a structured-output request is in its grammar (advanced by every sampled token); None: unconstrained.
    grammar: GrammarState | None = None
    # Speculative decoding: the proposed tokens to verify in the next step (set before each step); OpenAI's
    # predicted output, tokenized, for the proposer; and the counts behind usage's prediction tokens.
    spec_token_ids: list[int] = field(default_factory=list)
    prediction_token_ids: list[int] | None = None
    num_accepted_prediction_tokens: int = 0
    num_rejected_prediction_tokens: int = 0
    # With params.prompt_logprobs: one entry per prompt token computed so far (None for the first, which has no
    # context), each (logprob, rank, top ids, top logprobs) as the sampler's; handed out with the first token.
    prompt_logprobs: list | None = None
    # A pooling request (params.pooling): whether each chunk hands back all its rows (mean, CLS) or only the
    # prompt's last; the float32 sum of the rows so far, the first row, and how many prompt rows they cover.
    pool_all_rows: bool = False
    pool_sum: torch.Tensor | None = None
    pool_first: torch.Tensor | None = None
    pool_upto: int = 0

    def __post_init__(self) -> None:
        if self.params.prompt_logprobs is not None and self.prompt_logprobs is None:
            self.prompt_logprobs = [None]
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        stops = set(self.params.stop_token_ids)
        if not self.params.ignore_eos:
            stops |= set(self.eos_token_ids)
        self.stop_ids = tuple(sorted(stops))
        if self.params.seed is not None and not self.params.greedy:
            self.generator = torch.Generator().manual_seed(self.params.seed)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.all_token_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV cache (1 while decoding)."""
        return len(self.all_token_ids) - self.num_computed_tokens

    def update_hashes(self, block_size: int) -> None:
        """Hash every newly full block of all_token_ids (each block is hashed once)."""
        n_full = len(self.all_token_ids) // block_size
        while len(self.block_hashes) < n_full:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if i else None
            self.block_hashes.append(block_hash(parent, self.all_token_ids[i * block_size : (i + 1) * block_size]))

    def append_token(self, token_id: int) -> None:
        """Record one sampled token."""
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> bool:
        """Set finish_reason if the last token ends the sequence; True when finished."""
        t = self.output_token_ids[-1]
        n = len(self.output_token_ids)
        if n >= self.params.min_tokens:
            if t in self.params.stop_token_ids:
                self.finish_reason, self.stop_reason = "stop", t
                return True
            if not self.params.ignore_eos and t in self.eos_token_ids:
                self.finish_reason = "stop"
                return True
        if n >= self.max_tokens or len(self.all_token_ids) >= max_model_len:
            self.finish_reason = "length"
            return True
        return False
