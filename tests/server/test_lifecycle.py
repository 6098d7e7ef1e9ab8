"""Start-up, graceful shutdown on SIGTERM/SIGINT, and an engine process that dies."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

from .conftest import running_server, wait_healthy


def stream_in_background(server, results: list, max_tokens: int = 64) -> threading.Thread:
    """Start one streaming completion in a thread; its outcome lands in `results`."""

    def run():
        try:
            client = openai.OpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0, timeout=120)
            chunks = list(client.completions.create(model=_model(server), prompt="Tell me a long story about a dragon.",
                                                    max_tokens=max_tokens, temperature=0, stream=True,
                                                    extra_body={"ignore_eos": True}))
            results.append(("ok", sum(1 for c in chunks if c.choices and c.choices[0].text)))
        except Exception as e:  # recorded for the assertion
            results.append(("error", repr(e)))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def _model(server) -> str:
    r = httpx.get(server.v1 + "/models", headers=server.headers(), timeout=10)
    return r.json()["data"][0]["id"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_graceful_shutdown_finishes_in_flight_and_exits_0(sig):
    with running_server("--shutdown-timeout", "30") as server:
        results: list = []
        t = stream_in_background(server, results, max_tokens=48)
        time.sleep(1.0)  # the request is running
        server.proc.send_signal(sig)
        # New connections are refused soon after the signal.
        code = server.proc.wait(60)
        t.join(60)
        assert code == 0, server.log()[-3000:]
        assert results and results[0][0] == "ok", results
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url + "/health", timeout=2)


def test_shutdown_bound_aborts_long_requests():
    with running_server("--shutdown-timeout", "1", "--max-model-len", "4096") as server:
        results: list = []
        t = stream_in_background(server, results, max_tokens=4000)  # far longer than the bound
        time.sleep(1.0)
        start = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(60)
        elapsed = time.monotonic() - start
        t.join(30)
        assert code == 0, server.log()[-3000:]
        assert elapsed < 20, f"shutdown took {elapsed:.1f}s with a 1s bound"
        assert results, "the client thread did not finish"


def test_health_503_while_loading_then_200():
    with running_server(wait=False) as server:
        saw_503 = False
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                r = httpx.get(server.url + "/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.05)
                continue
            if r.status_code == 503:
                saw_503 = True
                assert "error" in r.json()
            elif r.status_code == 200:
                break
            time.sleep(0.05)
        assert saw_503, "never saw /health answer 503 while the model loaded"
        wait_healthy(server)


def test_engine_death_is_reported_and_requests_fail_fast():
    with running_server() as server:
        results: list = []
        t = stream_in_background(server, results, max_tokens=400)
        time.sleep(1.5)
        os.kill(server.engine_pid(), signal.SIGKILL)
        t.join(30)
        # The stream in flight ends with an error event instead of hanging.
        assert results and results[0][0] == "error", results
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health", timeout=5).status_code != 503:
            assert time.monotonic() < deadline, "/health still 200 after the engine died"
            time.sleep(0.1)
        start = time.monotonic()
        r = httpx.post(server.v1 + "/completions", headers=server.headers(), timeout=30,
                       json={"model": _model(server), "prompt": "hi", "max_tokens": 4})
        assert 500 <= r.status_code < 600 and "error" in r.json()
        assert time.monotonic() - start < 5
