"""One HTTP generation request while it runs: its prompts, the engine requests started for them, and what
each choice has produced so far."""

from __future__ import annotations

from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from cpuinfer.entrypoints.openai.engine_adapter import ChoiceDelta, TokenLogprob
from cpuinfer.entrypoints.openai.metrics import RequestTimer
from cpuinfer.entrypoints.openai.protocol import CompletionTokensDetails, UsageInfo
from cpuinfer.sampling_params import SamplingParams


@dataclass
class Prompt:
    """One tokenized prompt (text kept for echo)."""

    token_ids: list[int]
    text: str | None
    # Its own parameters where they differ from its request's (a cross-encoder pair's token types); None: the job's.
    params: SamplingParams | None = None


@dataclass
class ChoiceState:
    """What one choice has produced so far."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    prediction_tokens: tuple[int, int] | None = None  # its request's, all choices together
    pooled: object = None  # a pooling request's vector (torch float32), once it is done

    def absorb(self, d: ChoiceDelta) -> None:
        """Add a delta."""
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.prediction_tokens is not None:
            self.prediction_tokens = d.prediction_tokens
        if d.pooled is not None:
            self.pooled = d.pooled
        self.text += d.text
        self.token_ids += d.token_ids
        if d.logprobs:
            self.logprobs += d.logprobs
        if d.finish_reason is not None:
            self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason


@dataclass
class Job:
    """One HTTP request running on the engine: one engine request per prompt, n choices each (choice i
    of prompt p is states[p * n + i])."""

    request_id: str
    prompts: list[Prompt]
    n: int
    streams: list[tuple[str, AsyncIterator[list[ChoiceDelta]]]]  # (engine request id, its deltas), prompt order
    timer: RequestTimer
    states: list[ChoiceState] = field(default_factory=list)
    params: SamplingParams | None = None
    pending: deque[int] = field(default_factory=deque)  # prompts validated but not started yet (the window)
    metered_prompts: set[int] = field(default_factory=set)  # prompts whose tokens /metrics counts (an output came)
    metered_tokens: int = 0  # output tokens /metrics counts, all choices

    def __post_init__(self) -> None:
        self.states = [ChoiceState() for _ in range(self.n * len(self.prompts))]

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of all prompts."""
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        """Tokens generated so far, all choices."""
        return sum(len(s.token_ids) for s in self.states)

    def usage(self) -> UsageInfo:
        """Token counts so far."""
        c = self.completion_tokens
        usage = UsageInfo(prompt_tokens=self.prompt_tokens, completion_tokens=c, total_tokens=self.prompt_tokens + c)
        # Each prompt's engine request reports its choices' prediction tokens together: count one choice's.
        counts = [s.prediction_tokens for s in self.states[:: self.n] if s.prediction_tokens is not None]
        if counts:
            usage.completion_tokens_details = CompletionTokensDetails(
                accepted_prediction_tokens=sum(a for a, _ in counts),
                rejected_prediction_tokens=sum(r for _, r in counts),
            )
        return usage
