"""/v1/embeddings' body bounds, checked by the server's guard before anything is parsed or tokenized: input text
that no context (or the request's prompt-token cap) could hold is a 400 naming `input`, unless truncated."""

from __future__ import annotations

import pytest

from cpuinfer.entrypoints.openai.errors import APIError
from cpuinfer.entrypoints.openai.guard import CHECKED_ROUTES
from cpuinfer.entrypoints.openai.request_bounds import RequestBounds, check_body

ROUTE = "/v1/embeddings"


def check(body: dict) -> None:
    check_body(ROUTE, body, RequestBounds(), 100, 250)


def test_embeddings_route_is_checked_and_input_text_is_bounded():
    assert ROUTE in CHECKED_ROUTES
    check({"input": "x" * 100})
    check({"input": ["x" * 100, "y" * 100]})
    check({"input": [[1] * 1000]})  # token ids: the engine's limits judge them
    with pytest.raises(APIError, match="input has 101 characters") as e:
        check({"input": "x" * 101})
    assert e.value.param == "input"
    with pytest.raises(APIError, match="inputs hold 300 characters in all") as e:
        check({"input": ["x" * 100] * 3})
    assert e.value.param == "input"
    check({"input": "x" * 5000, "truncate_prompt_tokens": 10})  # only its last tokens count
