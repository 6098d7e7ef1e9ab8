"""Bodies of vLLM's scoring routes (pydantic): POST /score (text pairs), /rerank (Jina's and Cohere's shape: a query
and documents, results sorted by relevance) and /classify."""

from __future__ import annotations

import time
from typing import Annotated, ClassVar

from pydantic import BaseModel, Field

from cpuinfer.entrypoints.openai.protocol import OpenAIModel, UsageInfo, random_id
from cpuinfer.sampling_params import INT32_MAX

Truncate = Annotated[int, Field(strict=True, ge=-1, le=INT32_MAX)]  # keep k tokens (-1: the model's length)


class ScoreRequest(OpenAIModel):
    """POST /score: text_1 against each text_2 (1:1, 1:N), or text_1[i] with text_2[i] (N:N)."""

    ROUTE: ClassVar[str] = "/score"
    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: Truncate | None = None
    activation: bool | None = None  # a cross-encoder's sigmoid (or its config's activation); false: the raw logit
    request_id: str | None = None


class ScoreData(BaseModel):
    """One pair's score."""

    index: int
    object: str = "score"
    score: float


class ScoreResponse(BaseModel):
    """The answer of POST /score, pairs in request order."""

    id: str = Field(default_factory=lambda: random_id("score"))
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: UsageInfo


class RerankRequest(OpenAIModel):
    """POST /rerank (/v1/rerank, /v2/rerank): documents ranked by relevance to the query; top_n 0 keeps all."""

    ROUTE: ClassVar[str] = "/rerank"
    model: str | None = None
    query: str
    documents: list[str]
    top_n: Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)] = 0
    return_documents: bool = True
    truncate_prompt_tokens: Truncate | None = None
    activation: bool | None = None
    request_id: str | None = None


class RerankDocument(BaseModel):
    """A ranked document's text."""

    text: str


class RerankResult(BaseModel):
    """One document: its index in the request, its text (unless return_documents is false), its score."""

    index: int
    document: RerankDocument | None = None
    relevance_score: float


class RerankUsage(BaseModel):
    """Tokens the request ran (query and documents, as pairs or embedded)."""

    total_tokens: int


class RerankResponse(BaseModel):
    """The answer of POST /rerank: results by relevance, highest first."""

    id: str = Field(default_factory=lambda: random_id("rerank"))
    model: str
    usage: RerankUsage
    results: list[RerankResult]


class ClassificationRequest(OpenAIModel):
    """POST /classify: a sequence classifier's label scores of each input text."""

    ROUTE: ClassVar[str] = "/classify"
    model: str | None = None
    input: str | list[str]
    truncate_prompt_tokens: Truncate | None = None
    activation: bool | None = None  # sigmoid for one label, softmax for more; false: the raw logits
    request_id: str | None = None


class ClassificationData(BaseModel):
    """One input's scores: per label (probs), and the best label's name."""

    index: int
    label: str | None
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    """The answer of POST /classify, inputs in request order."""

    id: str = Field(default_factory=lambda: random_id("classify"))
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: UsageInfo
