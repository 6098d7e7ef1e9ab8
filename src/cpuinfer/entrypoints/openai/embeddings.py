"""POST /v1/embeddings: each input is one pooling request on the engine (openai/pooling.py's job).

The engine decides what is allowed (the runner, lengths, vocabulary, Matryoshka dimensions: engine/limits.py);
this turns the body into token ids and PoolingParams and the pooled vectors into OpenAI's response.
"""

from __future__ import annotations

import base64

import numpy as np

from cpuinfer.engine.limits import check_pooling_text
from cpuinfer.entrypoints.openai.embeddings_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from cpuinfer.entrypoints.openai.errors import APIError, to_api_error
from cpuinfer.entrypoints.openai.job import Prompt
from cpuinfer.entrypoints.openai.pooling import check_count, run_pooling
from cpuinfer.entrypoints.openai.protocol import random_id
from cpuinfer.sampling_params import PoolingParams


def request_inputs(req: EmbeddingRequest) -> list[str | list[int]]:
    """The body's inputs as a list (texts or token-id lists); an empty or too long list is a 400."""
    inp = req.input
    if isinstance(inp, str):
        return [inp]
    if not inp:
        raise APIError("input is empty: send a text, a list of texts, token ids or lists of token ids.", 400, "input")
    if all(isinstance(x, int) for x in inp):
        return [list(inp)]
    check_count(len(inp), "input")
    return list(inp)


def encode_vector(vec, encoding_format: str) -> list[float] | str:
    """A float32 vector as OpenAI sends it: a list of floats, or base64 of its little-endian float32 bytes."""
    arr = vec.numpy() if hasattr(vec, "numpy") else np.asarray(vec)
    if encoding_format == "base64":
        return base64.b64encode(arr.astype("<f4").tobytes()).decode("ascii")
    return arr.tolist()


async def create_embeddings(serving, req: EmbeddingRequest, raw=None) -> EmbeddingResponse | None:
    """POST /v1/embeddings on `serving` (an OpenAIServing): one pooling request per input, run as a completions
    request's prompts are (the same whole-request caps, the request window, metrics and logs); None when the
    client (`raw`, a starlette Request) left before it was done."""
    serving.check_model(req.model)
    serving.check_ready()
    engine = serving.engine
    keep = req.truncate_prompt_tokens
    if keep == -1:
        keep = engine.max_model_len
    try:
        params = PoolingParams(req.dimensions, req.normalize, keep or None)
        inputs = request_inputs(req)
        texts = [item for item in inputs if isinstance(item, str)]
        for text in texts:
            check_pooling_text(text)
    except ValueError as e:
        raise to_api_error(e) from e
    encoded = iter(await serving.encode_many(texts, req.add_special_tokens) if texts else [])
    prompts = []
    for item in inputs:
        ids, text = (next(encoded), item) if isinstance(item, str) else (list(item), None)
        prompts.append(Prompt(ids[-keep:] if keep else ids, text))
    job = await run_pooling(serving, req.request_id or random_id("embd"), prompts, params, raw, "input")
    if job is None:
        return None
    n = job.prompt_tokens
    data = [
        EmbeddingData(index=i, embedding=encode_vector(s.pooled, req.encoding_format)) for i, s in enumerate(job.states)
    ]
    return EmbeddingResponse(
        id=job.request_id, model=serving.model_name, data=data, usage=EmbeddingUsage(prompt_tokens=n, total_tokens=n)
    )
