"""Typed messages between the front end (tokenization, detokenization, HTTP) and the engine core.

They are plain picklable dataclasses, so the same objects cross a
multiprocessing pipe when the core runs in its own process.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cpuinfer.sampling_params import SamplingParams


@dataclass
class AddRequest:
    """Start one request. Its n samples run as n sequences named `child_ids` (just `request_id` when
    empty); the prompt and params cross the pipe once, however large n is."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    child_ids: list[str] = field(default_factory=list)
    prediction_token_ids: list[int] | None = None  # params.prediction, tokenized (the speculative proposer's)

    @property
    def sequence_ids(self) -> list[str]:
        """Engine-core ids of the request's sequences."""
        return self.child_ids or [self.request_id]


@dataclass
class AbortRequests:
    """Stop these sequences now; their blocks are freed."""

    request_ids: list[str]


@dataclass
class GetStats:
    """Ask for an EngineStats."""


@dataclass
class Shutdown:
    """Ask the core process to exit."""


@dataclass
class SeqOutput:
    """What one sequence produced in one step."""

    request_id: str
    new_token_ids: list[int]
    # Per new token: (sampled logprob, rank, top ids, top logprobs), or None when not requested.
    new_logprobs: list | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    # Set when the sequence failed inside the engine (finish_reason "error"): the id of the log entry
    # that holds the details. The engine goes on with the other sequences.
    error_id: str | None = None
    # With error_id, when the request itself is at fault: a message safe for the client, and its field.
    error_reason: str | None = None
    error_param: str | None = None
    # Predicted outputs: of the proposals taken from the request's prediction so far, those accepted and
    # those rejected (OpenAI's usage.completion_tokens_details); cumulative.
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    # With the first token of a request that asked for prompt logprobs: one entry per prompt token (None first).
    prompt_logprobs: list | None = None
    # A pooling request's result, when its prompt is done: the pooled float32 vector.
    pooled: torch.Tensor | None = None


@dataclass
class Heartbeat:
    """Sent by the core every fraction of --engine-heartbeat-timeout, from its own thread: the core
    process is alive and scheduled (kernels release the GIL, so a long step does not silence it)."""

    seq: int


@dataclass
class EngineStats:
    """Counters of the engine core (cumulative ones since start): the one stats type, from the core to
    AsyncLLM / LLMEngine and on to the server's /metrics and its periodic log."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks held by requests
    num_kv_blocks: int = 0
    num_free_kv_blocks: int = 0  # not held by any request (cached prefix blocks nobody holds count as free)
    prefix_cache_hit_rate: float = 0.0  # cached prompt tokens / looked-up prompt tokens
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_preemptions: int = 0
    # The host prefix tier (--kv-offloading-size; all 0 without it): its size and what it holds now, bytes
    # saved to it and copied back from it, and, as vLLM's external prefix cache, the prompt tokens looked up
    # past the KV cache's hits and those restored.
    kv_offload_capacity_bytes: int = 0
    kv_offload_bytes: int = 0
    kv_offload_stored_bytes: int = 0
    kv_offload_restored_bytes: int = 0
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    prompt_tokens: int = 0  # tokens computed in prefill (recomputation included)
    generation_tokens: int = 0
    num_steps: int = 0
    # Speculative decoding (vLLM's spec_decode counters): sequence-steps with proposals, proposed and
    # accepted tokens, and accepted tokens by position in the proposal.
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_accepted_per_pos: list[int] = field(default_factory=list)


@dataclass
class StepResult:
    """One engine step's outputs, plus a request's failure if one could not be accepted."""

    outputs: list[SeqOutput] = field(default_factory=list)
    errors: dict[str, str] = field(default_factory=dict)  # request_id -> why the core refused it


def merge_stats(live: list[EngineStats], gone: list[EngineStats] = ()) -> EngineStats:
    """One EngineStats for several engine cores (data parallel): counts and counters add up, KV usage is
    weighted by pool size, the hit rate is recomputed from the summed hits and queries.

    `gone`: the last stats of dead cores, whose cumulative counters still count (a Prometheus counter must not
    go down) but whose queues and KV blocks no longer exist."""
    out = EngineStats()
    for s in [*live, *gone]:
        out.prefix_cache_queries += s.prefix_cache_queries
        out.prefix_cache_hits += s.prefix_cache_hits
        out.num_preemptions += s.num_preemptions
        out.kv_offload_stored_bytes += s.kv_offload_stored_bytes
        out.kv_offload_restored_bytes += s.kv_offload_restored_bytes
        out.external_prefix_cache_queries += s.external_prefix_cache_queries
        out.external_prefix_cache_hits += s.external_prefix_cache_hits
        out.prompt_tokens += s.prompt_tokens
        out.generation_tokens += s.generation_tokens
        out.num_steps += s.num_steps
        out.spec_decode_num_drafts += s.spec_decode_num_drafts
        out.spec_decode_num_draft_tokens += s.spec_decode_num_draft_tokens
        out.spec_decode_num_accepted_tokens += s.spec_decode_num_accepted_tokens
        per_pos = s.spec_decode_accepted_per_pos
        if len(out.spec_decode_accepted_per_pos) < len(per_pos):
            out.spec_decode_accepted_per_pos += [0] * (len(per_pos) - len(out.spec_decode_accepted_per_pos))
        for j, c in enumerate(per_pos):
            out.spec_decode_accepted_per_pos[j] += c
    for s in live:
        out.num_running += s.num_running
        out.num_waiting += s.num_waiting
        out.num_kv_blocks += s.num_kv_blocks
        out.num_free_kv_blocks += s.num_free_kv_blocks
        out.kv_offload_capacity_bytes += s.kv_offload_capacity_bytes
        out.kv_offload_bytes += s.kv_offload_bytes
    if out.num_kv_blocks:
        out.kv_cache_usage = sum(s.kv_cache_usage * s.num_kv_blocks for s in live) / out.num_kv_blocks
    if out.prefix_cache_queries:
        out.prefix_cache_hit_rate = out.prefix_cache_hits / out.prefix_cache_queries
    return out
