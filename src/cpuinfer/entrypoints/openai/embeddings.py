"""POST /v1/embeddings: each input is one pooling request on the engine, all started at once so they share steps.

The engine decides what is allowed (the runner, lengths, vocabulary, Matryoshka dimensions: engine/limits.py);
this turns the body into token ids and PoolingParams and the pooled vectors into OpenAI's response.
"""

from __future__ import annotations

import base64
import contextlib
import time

import numpy as np

from cpuinfer.engine.limits import check_pooling_text
from cpuinfer.entrypoints.openai.embeddings_protocol import (
    EmbeddingData,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingUsage,
)
from cpuinfer.entrypoints.openai.errors import APIError, to_api_error
from cpuinfer.entrypoints.openai.protocol import random_id
from cpuinfer.sampling_params import PoolingParams

MAX_INPUTS = 2048  # OpenAI's limit of inputs in one embeddings request


def request_inputs(req: EmbeddingRequest) -> list[str | list[int]]:
    """The body's inputs as a list (texts or token-id lists); an empty or too long list is a 400."""
    inp = req.input
    if isinstance(inp, str):
        return [inp]
    if not inp:
        raise APIError("input is empty: send a text, a list of texts, token ids or lists of token ids.", 400, "input")
    if all(isinstance(x, int) for x in inp):
        return [list(inp)]
    if len(inp) > MAX_INPUTS:
        raise APIError(f"input has {len(inp)} items; at most {MAX_INPUTS} are allowed in one request.", 400, "input")
    return list(inp)


def encode_vector(vec, encoding_format: str) -> list[float] | str:
    """A float32 vector as OpenAI sends it: a list of floats, or base64 of its little-endian float32 bytes."""
    arr = vec.numpy() if hasattr(vec, "numpy") else np.asarray(vec)
    if encoding_format == "base64":
        return base64.b64encode(arr.astype("<f4").tobytes()).decode("ascii")
    return arr.tolist()


async def create_embeddings(serving, req: EmbeddingRequest) -> EmbeddingResponse:
    """POST /v1/embeddings on `serving` (an OpenAIServing): one pooling request per input."""
    serving.check_model(req.model)
    serving.check_ready()
    engine = serving.engine
    keep = req.truncate_prompt_tokens
    if keep == -1:
        keep = engine.max_model_len
    try:
        params = PoolingParams(req.dimensions, req.normalize, keep or None).as_sampling()
        token_lists = []
        for item in request_inputs(req):
            if isinstance(item, str):
                check_pooling_text(item)
                item = await serving.encode(item, req.add_special_tokens)
            token_lists.append(item[-keep:] if keep else list(item))
    except ValueError as e:
        raise to_api_error(e) from e
    rid = req.request_id or random_id("embd")
    start = time.perf_counter()
    streams = []
    try:
        for i, ids in enumerate(token_lists):
            streams.append(engine.submit(f"{rid}-{i}", ids, params))
        vectors = [await _pooled(s) for s in streams]
    except Exception as e:
        for s in streams:
            with contextlib.suppress(Exception):
                await s.aclose()  # aborts what still runs
        raise to_api_error(e, rid) from e
    n = sum(len(ids) for ids in token_lists)
    metrics = serving.responder.metrics
    if metrics is not None:  # as a generation request counts: its prompt tokens, its latency, one success
        metrics.prompt_tokens.inc(n)
        metrics.request_prompt_tokens.observe(n)
        metrics.e2e.observe(time.perf_counter() - start)
        metrics.request_finished("stop")
    data = [EmbeddingData(index=i, embedding=encode_vector(v, req.encoding_format)) for i, v in enumerate(vectors)]
    return EmbeddingResponse(
        id=rid, model=serving.model_name, data=data, usage=EmbeddingUsage(prompt_tokens=n, total_tokens=n)
    )


async def _pooled(stream):
    """The vector a pooling request's deltas end with."""
    vec = None
    async for deltas in stream:
        for d in deltas:
            if d.pooled is not None:
                vec = d.pooled
    if vec is None:
        raise RuntimeError("a pooling request finished without its vector")
    return vec
