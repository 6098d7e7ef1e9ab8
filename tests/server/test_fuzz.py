"""Property-based fuzzing of the API from its own OpenAPI document (schemathesis): no 5xx, no hang."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from .conftest import running_server

FUZZ_MODEL_LEN = 40  # bounds the work any generated request can ask for (the chat template alone is ~30 tokens)
# Lower documented maxima so positive examples stay cheap on 2 cores (negative examples still go past them):
CAPS = {"n": 3, "max_tokens": 4, "max_completion_tokens": 4, "min_tokens": 4}


@pytest.fixture(scope="module")
def server():
    with running_server("--max-model-len", str(FUZZ_MODEL_LEN), "--max-num-seqs", "16") as s:
        yield s


def _cap(node) -> None:
    """Lower the maxima of the costly fields in the document (the server's validation is unchanged)."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in CAPS and isinstance(value, dict):
                for schema in [value, *value.get("anyOf", [])]:
                    if schema.get("type") == "integer":
                        schema["maximum"] = CAPS[key]
            _cap(value)
    elif isinstance(node, list):
        for item in node:
            _cap(item)


@pytest.fixture(scope="module")
def operations(server):
    """Every operation of the server's own OpenAPI document (with the costly maxima lowered)."""
    doc = httpx.get(server.url + "/openapi.json", headers=server.headers(), timeout=10).json()
    _cap(doc)
    schema = schemathesis.openapi.from_dict(doc)
    ops = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in ops}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"} <= paths, paths
    return ops


def test_no_server_errors_and_no_hangs(operations, server):
    """Valid and invalid requests for every route: never a 5xx, always an OpenAI-shaped error, never a hang.

    Hypothesis drives schemathesis' per-operation strategies directly (rather than through schemathesis'
    pytest plugin, whose internals break with each pytest release). Random generation only: the
    deterministic boundary-case phase would send ~150 cases per generating route (minutes on 2 cores);
    the documented bounds are tested one by one in test_openai_api.
    """
    for operation in operations:
        strategy = st.one_of(
            operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE)
        )

        @given(case=strategy)
        @settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call(base_url=server.url, headers=server.headers(), timeout=60)
            assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:500])
            if response.status_code >= 400:
                err = response.json()["error"]
                assert err["message"] and err["code"] == response.status_code, response.text[:500]

        check()
    assert server.proc.poll() is None, "the server died while being fuzzed"
