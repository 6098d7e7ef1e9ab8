"""Bodies of POST /v1/embeddings as OpenAI and vLLM define them (pydantic)."""

from __future__ import annotations

import time
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, Field

from cpuinfer.entrypoints.openai.protocol import OpenAIModel, random_id
from cpuinfer.sampling_params import INT32_MAX

TokenId = Annotated[int, Field(strict=True, ge=0, le=INT32_MAX)]


class EmbeddingRequest(OpenAIModel):
    """POST /v1/embeddings: one input or a list of them, each a text or token ids."""

    ROUTE: ClassVar[str] = "/v1/embeddings"
    model: str | None = None
    input: str | list[str] | list[TokenId] | list[list[TokenId]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(strict=True, ge=1, le=INT32_MAX)] | None = None
    user: str | None = None
    # vLLM's extras: keep the last k tokens of each input (-1: the model's length); special tokens; normalize.
    truncate_prompt_tokens: Annotated[int, Field(strict=True, ge=-1, le=INT32_MAX)] | None = None
    add_special_tokens: bool = True
    normalize: bool | None = None
    request_id: str | None = None


class EmbeddingData(BaseModel):
    """One input's vector: floats, or base64 of its little-endian float32 bytes (OpenAI's encoding)."""

    object: str = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    """Token counts of one embeddings request (no completion tokens)."""

    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingResponse(BaseModel):
    """The answer of POST /v1/embeddings."""

    id: str = Field(default_factory=lambda: random_id("embd"))
    object: str = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage
