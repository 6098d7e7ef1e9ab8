"""Property-based fuzzing of the API from its own OpenAPI document (schemathesis): no 5xx, no hang, every
stream parsed to its end, /health answering within a second after every case.

Values are not capped: the server's short context (FUZZ_MODEL_LEN tokens) is what bounds the work any
generated request can ask for, so n, max_tokens, min_tokens, stop lists and penalties range over their
whole documented (and undocumented: negative examples) domain.
"""

from __future__ import annotations

import json
import os
import re
import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from .conftest import running_server

FUZZ_MODEL_LEN = 40  # the chat template alone is ~30 tokens
# Cases per route (>= 1,000 in all); the generating routes get the most. CPUINFER_FUZZ_SCALE scales them.
SCALE = float(os.environ.get("CPUINFER_FUZZ_SCALE", "1"))
EXAMPLES = {"/v1/completions": 420, "/v1/chat/completions": 420, "/tokenize": 120, "/detokenize": 80}
STREAMING = {"/v1/completions", "/v1/chat/completions"}
OTHER_EXAMPLES = 25
HEALTH_BOUND = 1.0  # seconds


@pytest.fixture(scope="module")
def server():
    with running_server("--max-model-len", str(FUZZ_MODEL_LEN), "--max-num-seqs", "16") as s:
        yield s


@pytest.fixture(scope="module")
def operations(server):
    """Every operation of the server's own OpenAPI document."""
    doc = httpx.get(server.url + "/openapi.json", headers=server.headers(), timeout=10).json()
    schema = schemathesis.openapi.from_dict(doc)
    ops = [result.ok() for result in schema.get_all_operations()]
    paths = {op.path for op in ops}
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"} <= paths, paths
    return ops


class Reply:
    """An httpx response with the attributes the checks read off schemathesis' responses."""

    def __init__(self, r: httpx.Response):
        self.status_code, self.text, self.headers = r.status_code, r.text, dict(r.headers)

    def json(self):
        return json.loads(self.text)


def content_type(response) -> str:
    """The response's Content-Type (schemathesis' responses keep each header as a list of values)."""
    value = response.headers.get("content-type") or ""
    return (value[0] if value else "") if isinstance(value, list) else value


def check_stream(text: str, complete: bool = True) -> None:
    """An event stream: JSON events, at most one error event (the last before [DONE]), then [DONE]. A stream
    the client stopped reading (complete=False) may end anywhere; what it read must still hold."""
    # SSE lines end at CR or LF only; str.splitlines() would also split inside generated text at U+2028,
    # U+0085 or \x1c (JSON leaves those unescaped).
    events = [line[len("data: ") :] for line in re.split(r"\r\n|\r|\n", text) if line.startswith("data: ")]
    if complete or (events and events[-1] == "[DONE]"):
        assert events and events[-1] == "[DONE]", text[-500:]
        events = events[:-1]
    bodies = [json.loads(e) for e in events]
    errors = [i for i, b in enumerate(bodies) if "error" in b]
    assert errors in ([], [len(bodies) - 1]), text[-500:]
    for i in errors:
        assert bodies[i]["error"]["message"] and "Traceback" not in bodies[i]["error"]["message"]


def test_no_server_errors_no_hangs_streams_complete_and_health_stays_fast(operations, server):
    """Valid and invalid requests for every route: never a 5xx, always an OpenAI-shaped error, every stream
    ends with [DONE], /health answers 200 within HEALTH_BOUND after each case.

    Hypothesis drives schemathesis' per-operation strategies directly (rather than through schemathesis'
    pytest plugin, whose internals break with each pytest release). Random generation only: the
    deterministic boundary-case phase would send ~150 cases per generating route on top.
    """
    counts = {"cases": 0, "5xx": 0, "streams": 0, "streams cut short by schemathesis": 0}
    health = httpx.Client(timeout=10)
    for operation in operations:
        strategy = st.one_of(
            operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE)
        )
        examples = max(1, round(EXAMPLES.get(operation.path, OTHER_EXAMPLES) * SCALE))
        path = operation.path
        streams = path in STREAMING

        @given(case=strategy, stream=st.booleans())
        @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case, stream):
            counts["cases"] += 1
            if stream and streams and isinstance(case.body, dict):  # noqa: B023 - check() runs in this iteration
                # Half the generating cases as streams, read to the end here: schemathesis' own transport
                # stops reading an event stream after a few events.
                case.body["stream"] = True
                response = Reply(
                    health.post(
                        server.url + path,  # noqa: B023 - as above
                        json=case.body,
                        headers=server.headers(),
                        timeout=60,
                    )
                )
            else:
                response = case.call(base_url=server.url, headers=server.headers(), timeout=60)
            if response.status_code >= 500:
                counts["5xx"] += 1
            assert response.status_code < 500, (case.as_curl_command(), response.status_code, response.text[:500])
            if response.status_code >= 400:
                err = response.json()["error"]
                assert err["message"] and err["code"] == response.status_code, response.text[:500]
                assert "Traceback" not in response.text, response.text[:500]
            elif content_type(response).startswith("text/event-stream"):
                # schemathesis' transport stops reading a stream it asked for after 20 events (and says so)
                cut_short = getattr(response, "stream_cut_short", False)
                counts["streams cut short by schemathesis" if cut_short else "streams"] += 1
                check_stream(response.text, complete=not cut_short)
            t0 = time.monotonic()
            r = health.get(server.url + "/health")
            assert r.status_code == 200 and time.monotonic() - t0 < HEALTH_BOUND, (r.status_code, r.text)

        check()
    health.close()
    print(f"fuzz: {counts}")
    assert counts["cases"] >= 1000 * SCALE * 0.9
    assert server.proc.poll() is None, "the server died while being fuzzed"
