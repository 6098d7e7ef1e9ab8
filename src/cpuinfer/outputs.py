"""Result objects shaped like vLLM's: `RequestOutput` holding one `CompletionOutput` per sample."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Logprob:
    """Log-probability of one candidate token, its rank (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per generated token: candidate token id -> Logprob (the sampled token is always included).
SampleLogprobs = list[dict[int, Logprob]]
# The same per prompt token, None for the first (nothing precedes it), as vLLM's.
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    """One generated sequence of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop", "length", "abort", "error" or None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it

    def finished(self) -> bool:
        """True once this sequence is done."""
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """Everything produced so far for one request."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # Set when the request failed inside the engine (its samples end with finish_reason "error"):
    # the id under which the engine logged the details.
    error_id: str | None = None
    # With error_id, when the request itself is at fault (a client error): what to tell the client, and
    # the request field it concerns.
    error_reason: str | None = None
    error_param: str | None = None
    # A pooling request's result (a torch float32 vector), once finished; None for generation.
    pooled: Any = None


@dataclass
class EmbeddingOutput:
    """One input's embedding (vLLM's EmbeddingOutput)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        """Length of the vector."""
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per input (vLLM's shape: `.outputs.embedding`)."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationOutput:
    """One input's classifier scores, one per label (vLLM's ClassificationOutput)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        """Number of labels."""
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """What LLM.classify returns per input (`.outputs.probs`)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    """One text pair's score (vLLM's ScoringOutput)."""

    score: float


@dataclass
class ScoringRequestOutput:
    """What LLM.score returns per pair (`.outputs.score`)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True
