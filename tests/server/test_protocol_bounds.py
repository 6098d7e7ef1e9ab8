"""The HTTP schema and SamplingParams accept exactly the same values for every sampling field, so a request
the schema lets through is never refused later, after a streaming response has started (and the reverse)."""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from cpuinfer.entrypoints.openai.protocol import CompletionRequest
from cpuinfer.sampling_params import SamplingParams

# field -> values on both sides of each bound (and inside)
PROBES = {
    "n": [0, 1, 128, 129],
    "temperature": [-1e-9, 0.0, 1e6, 1e6 * (1 + 1e-9), math.inf],
    "top_p": [0.0, 1e-9, 1.0, 1.0 + 1e-9],
    "top_k": [-2, -1, 0, 1, 2**31 - 1, 2**31],
    "min_p": [-1e-9, 0.0, 1.0, 1.0 + 1e-9],
    "presence_penalty": [-2.0 - 1e-9, -2.0, 2.0, 2.0 + 1e-9],
    "frequency_penalty": [-2.0 - 1e-9, -2.0, 2.0, 2.0 + 1e-9],
    "repetition_penalty": [0.0, 1e-9, 1e4, 1e4 + 1e-6, 5e4],
    "seed": [-(2**63) - 1, -(2**63), 2**63 - 1, 2**63],
    "max_tokens": [0, 1, 2**31 - 1, 2**31],
    "min_tokens": [-1, 0, 2**31 - 1, 2**31],
    "stop_token_ids": [[-1], [0], [2**31 - 1], [2**31]],
}


def http_accepts(field: str, value) -> bool:
    body = {"prompt": "hi", field: value}
    if field == "min_tokens":
        body["max_tokens"] = None  # min_tokens alone (max_tokens is the engine's to resolve)
    try:
        CompletionRequest.model_validate(body)
        return True
    except ValidationError:
        return False


def params_accept(field: str, value) -> bool:
    kw = {field: value}
    if field == "min_tokens":
        kw["max_tokens"] = None
    try:
        SamplingParams(**kw)
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("field", sorted(PROBES))
def test_schema_and_sampling_params_agree(field):
    for value in PROBES[field]:
        assert http_accepts(field, value) == params_accept(field, value), (field, value)
