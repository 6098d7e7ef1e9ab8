"""`cpuinfer serve -dp 2` (mp backend): two engine core processes behind one API server.

Each core gets its own CPU (VLLM_CPU_OMP_THREADS_BIND="a|b", one list per data-parallel rank), so on CI's
2 cores the two cores really run side by side. Checked with the official client: the 64-client blast of
test_load gives the sequential reference's greedy answers and both cores got requests; a client that hangs
up is aborted on the core that ran it; a killed core fails only its own in-flight requests, /health says
which one is gone, and the other core keeps serving until it dies too (then the server exits 1).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from tests.cpus import machine_cpus

from .conftest import free_port, metric, running_server, server_env
from .test_lifecycle import _model, raw_stream
from .test_load import blast_and_check


def dp_env() -> dict:
    """One CPU per core where there are two, else unbound."""
    cpus = machine_cpus()
    bind = f"{cpus[0]}|{cpus[1]}" if len(cpus) >= 2 else "nobind"
    return server_env(VLLM_CPU_OMP_THREADS_BIND=bind)


def core_metric(text: str, name: str, rank: int) -> float:
    """A per-core sample (label dp_rank) of a Prometheus exposition."""
    for line in text.splitlines():
        if line.startswith(name + "{") and f'dp_rank="{rank}"' in line:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} for dp_rank {rank} not found")


def scrape(server) -> str:
    return httpx.get(server.url + "/metrics", headers=server.headers(), timeout=10).text


def core_pid(server, rank: int) -> int:
    """The pid of data-parallel rank `rank`'s engine core, from the startup log."""
    found = re.findall(rf"data-parallel rank {rank}: engine core process pid (\d+)", server.log())
    assert found, server.log()[-3000:]
    return int(found[-1])


@pytest.fixture(scope="module")
def dp_server():
    with running_server("-dp", "2", env=dp_env()) as s:
        yield s


def test_startup_log_shows_each_core_and_its_cpus(dp_server):
    log = dp_server.log()
    for rank in (0, 1):
        assert re.search(rf"data-parallel rank {rank}: engine core process pid \d+ on \S+: rank 0 -> cores \d", log)
    assert core_pid(dp_server, 0) != core_pid(dp_server, 1)


def test_64_streams_equal_the_sequential_reference_and_both_cores_serve(dp_server):
    model = _model(dp_server)
    blast_and_check(dp_server, model)
    text = scrape(dp_server)
    routed = [core_metric(text, "cpuinfer:engine_core_requests_routed_total", r) for r in (0, 1)]
    assert min(routed) >= 8, f"requests per core: {routed}"  # least-loaded routing spreads the blast
    assert sum(routed) >= 64 + 8
    assert metric(text, "cpuinfer:kv_cache_blocks_total") == 2 * core_blocks(dp_server)


def core_blocks(server) -> int:
    """KV blocks of one core, from the log."""
    return int(re.findall(r"data-parallel rank 0: .*; (\d+) KV blocks", server.log())[-1])


def test_a_client_that_hangs_up_is_aborted_on_its_core(dp_server):
    client = openai.OpenAI(base_url=dp_server.v1, api_key=dp_server.api_key, max_retries=0, timeout=60)
    model = _model(dp_server)
    before = [core_metric(scrape(dp_server), "cpuinfer:engine_core_requests_routed_total", r) for r in (0, 1)]
    stream = client.completions.create(
        model=model,
        prompt="Tell me a long story.",
        max_tokens=400,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))  # the request is running now
    text = scrape(dp_server)
    after = [core_metric(text, "cpuinfer:engine_core_requests_routed_total", r) for r in (0, 1)]
    rank = 0 if after[0] > before[0] else 1
    assert core_metric(text, "cpuinfer:engine_core_num_requests_running", rank) == 1
    stream.close()  # hang up
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        text = scrape(dp_server)
        if core_metric(text, "cpuinfer:engine_core_num_requests_running", rank) == 0:
            break
        time.sleep(0.1)
    assert core_metric(text, "cpuinfer:engine_core_num_requests_running", rank) == 0
    assert metric(text, "cpuinfer:kv_cache_blocks_free") == metric(text, "cpuinfer:kv_cache_blocks_total")


def test_a_killed_core_fails_its_requests_and_the_other_keeps_serving():
    with running_server("-dp", "2", env=dp_env()) as server:
        model = _model(server)
        events: list[list] = [[], []]
        threads = []
        for i in range(2):  # the second goes to the other core: it is the less loaded one
            threads.append(raw_stream(server, events[i], max_tokens=300))
            wait_routed(server, i + 1, i + 1)
        text = scrape(server)
        assert [core_metric(text, "cpuinfer:engine_core_requests_routed_total", r) for r in (0, 1)] == [1, 1]

        t0 = time.monotonic()
        os.kill(core_pid(server, 1), signal.SIGKILL)
        # Which stream ran on core 1 is not known here; the one that ends first with an error event is it.
        failed_after = one_stream_fails(events, threads, t0, 20)
        assert failed_after < 10, f"the dead core's stream took {failed_after:.1f}s to fail"

        # /health names the dead core; the server keeps serving on the other one.
        r = httpx.get(server.url + "/health", timeout=5)
        assert r.status_code == 503 and r.json()["status"] == "degraded", r.text
        assert "core(s) 1 of 2" in r.json()["error"]["message"]
        client = openai.OpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0, timeout=60)
        for i in range(4):
            out = client.completions.create(model=model, prompt=f"Count to {i}:", max_tokens=4, temperature=0)
            assert out.choices[0].finish_reason == "length"
        text = scrape(server)
        assert core_metric(text, "cpuinfer:engine_core_up", 1) == 0
        assert core_metric(text, "cpuinfer:engine_core_up", 0) == 1
        assert core_metric(text, "cpuinfer:engine_core_requests_routed_total", 1) == 1
        assert server.proc.poll() is None
        assert "dead data-parallel engine core rank 1" in server.log()

        # The last core dies: the server exits 1, as a single-core server does.
        os.kill(core_pid(server, 0), signal.SIGKILL)
        assert server.proc.wait(30) == 1, server.log()[-3000:]
        assert "every data-parallel engine core died" in server.log()


def one_stream_fails(events: list[list[str]], threads, t0: float, timeout: float) -> float:
    """Two raw streams (test_lifecycle.raw_stream), one on a core that was just lost: wait for the first to end,
    then both; exactly one must end in a 5xx error event without a traceback, the other run to its length.
    Returns the seconds from t0 until the first ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not any(e and e[-1] == "data: [DONE]" for e in events):
        time.sleep(0.05)
    first_end = time.monotonic() - t0
    for t in threads:
        t.join(120)
    ends = [json.loads(e[-2][len("data: ") :]) for e in events]
    errors = [end for end in ends if "error" in end]
    assert len(errors) == 1, ends
    assert errors[0]["error"]["code"] in (500, 503) and "Traceback" not in errors[0]["error"]["message"]
    assert next(end for end in ends if "error" not in end)["choices"][0]["finish_reason"] == "length"
    return first_end


def wait_routed(server, routed: int, running: int, timeout: float = 60) -> None:
    """Until `routed` requests were routed since start and `running` of them run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        text = scrape(server)
        now = sum(core_metric(text, "cpuinfer:engine_core_requests_routed_total", r) for r in (0, 1))
        if now >= routed and metric(text, "vllm:num_requests_running") >= running:
            return
        time.sleep(0.05)
    raise AssertionError(f"never saw {routed} requests routed and {running} running")


@pytest.mark.skipif(len(machine_cpus()) < 2, reason="needs 2 CPUs (one per rank)")
def test_one_rank_per_server_for_an_external_load_balancer():
    # --data-parallel-rank by hand: this server runs rank 1's core only, on rank 1's share of the cores.
    with running_server("-dp", "2", "--data-parallel-rank", "1", env=dp_env()) as server:
        cpus = machine_cpus()
        assert re.search(rf"data-parallel rank 1: engine core rank 0 -> cores {cpus[1]}\b", server.log()), server.log()
        assert "data-parallel rank 1 of 2 (an external load balancer routes" in server.log()
        out = httpx.post(
            server.v1 + "/completions",
            headers=server.headers(),
            json={"prompt": "Hi", "max_tokens": 2},
            timeout=60,
        )
        assert out.status_code == 200, out.text
        text = scrape(server)
        assert core_metric(text, "cpuinfer:engine_core_requests_routed_total", 1) == 1


@pytest.mark.parametrize(
    "flags, message",
    [
        (["-dp", "0"], "--data-parallel-size=0 must be a positive integer"),
        (["-dp", "2", "--data-parallel-rank", "2"], "--data-parallel-rank=2 must be in 0..1"),
    ],
)
def test_bad_data_parallel_flags_exit_1_naming_them(flags, message):
    r = subprocess.run(
        [sys.executable, "-m", "cpuinfer", "serve", "--port", str(free_port()), *flags],
        capture_output=True,
        text=True,
        timeout=180,
        env=server_env(),
    )
    assert r.returncode == 1
    assert message in r.stdout + r.stderr
