"""`cpuinfer serve -dp 2 --data-parallel-backend ray` on a two-node Ray cluster on loopback.

`ray.cluster_utils.Cluster` starts a head and a worker node on this machine, one CPU each, so the two engine
cores (one placement-group bundle of one CPU each) land one per node. The server connects through
RAY_ADDRESS, as it would to a cluster made with `ray start`. Then the worker node is removed under load: the
stream on its core fails at once with an error event, /health says which core is gone, and the core on the
head keeps serving. Skipped without Ray (pip install 'cpuinfer[ray]'); `nox -s ray` runs it.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from .conftest import free_port, running_server, server_env
from .test_data_parallel import core_metric, dp_env, one_stream_fails, scrape, wait_routed
from .test_lifecycle import _model, raw_stream

ray_cluster_utils = pytest.importorskip("ray.cluster_utils")

PROMPTS = [f"Give me a fact about the number {i}:" for i in range(6)]


@pytest.fixture(scope="module")
def cluster():
    """Head + one worker node on this machine, one CPU each; the test process itself is no Ray driver."""
    c = ray_cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    worker = c.add_node(num_cpus=1)
    c.wait_for_nodes()
    try:
        yield c, worker
    finally:
        c.shutdown()


def placed_node(log: str, rank: int) -> str:
    """The (12-character) Ray node id the server placed data-parallel rank `rank` on."""
    found = re.findall(rf"data-parallel rank {rank}: Ray node (\w+) ", log)
    assert found, log[-3000:]
    return found[-1]


def serve_fails(env_extra: dict, *flags: str) -> str:
    """Run `cpuinfer serve` that must exit 1; its output."""
    r = subprocess.run(
        [sys.executable, "-m", "cpuinfer", "serve", "--port", str(free_port()), *flags],
        capture_output=True,
        text=True,
        timeout=180,
        env={**server_env(), **env_extra},
    )
    assert r.returncode == 1, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout + r.stderr


def test_more_cores_than_the_cluster_holds_is_one_clear_error(cluster):
    c, _ = cluster
    out = serve_fails({"RAY_ADDRESS": c.address}, "-dp", "3", "--data-parallel-backend", "ray")
    assert "--data-parallel-size 3 with the ray backend needs 3 bundles of 1 CPUs" in out
    assert "hold 2" in out


def test_an_unreachable_ray_address_is_one_clear_error():
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    out = serve_fails({"RAY_ADDRESS": address}, "-dp", "2", "--data-parallel-backend", "ray")
    assert f"cannot reach the Ray cluster at RAY_ADDRESS={address}" in out and "ray start --head" in out


def test_two_nodes_serve_and_losing_one_is_survived(cluster):
    c, worker = cluster
    env = dp_env()
    env["RAY_ADDRESS"] = c.address
    with running_server("-dp", "2", "--data-parallel-backend", "ray", env=env) as server:
        log = server.log()
        nodes = [placed_node(log, r) for r in (0, 1)]
        assert len(set(nodes)) == 2, nodes  # one engine core per node
        lost = nodes.index(worker.node_id[:12])

        # Served right: concurrent greedy answers equal the sequential ones, and both cores took requests.
        model = _model(server)
        client = openai.OpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0, timeout=120)
        reference = {
            p: client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
            for p in PROMPTS
        }

        async def together():
            async with openai.AsyncOpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0) as ac:
                import asyncio

                outs = await asyncio.gather(
                    *(ac.completions.create(model=model, prompt=p, max_tokens=8, temperature=0) for p in PROMPTS * 2)
                )
                return [o.choices[0].text for o in outs]

        import asyncio

        assert asyncio.run(together()) == [reference[p] for p in PROMPTS * 2]
        text = scrape(server)
        assert all(core_metric(text, "cpuinfer:engine_core_requests_routed_total", r) > 0 for r in (0, 1))

        # Two long streams, one per core (the second goes to the less loaded one), then the worker node goes.
        base = sum(core_metric(text, "cpuinfer:engine_core_requests_routed_total", r) for r in (0, 1))
        events: list[list] = [[], []]
        threads = []
        for i in range(2):
            threads.append(raw_stream(server, events[i], max_tokens=300))
            wait_routed(server, base + i + 1, i + 1)
        t0 = time.monotonic()
        c.remove_node(worker, allow_graceful=False)  # its raylet and workers are killed, as when a machine dies
        removed_in = time.monotonic() - t0
        failed_after = one_stream_fails(events, threads, t0, 30)
        assert failed_after < 15, f"the lost core's stream failed {failed_after:.1f}s after the node went"

        r = httpx.get(server.url + "/health", timeout=5)
        assert r.status_code == 503 and r.json()["status"] == "degraded", r.text
        assert f"core(s) {lost} of 2" in r.json()["error"]["message"]
        for p in PROMPTS[:3]:
            assert (
                client.completions.create(model=model, prompt=p, max_tokens=8, temperature=0).choices[0].text
                == (reference[p])
            )
        text = scrape(server)
        assert core_metric(text, "cpuinfer:engine_core_up", lost) == 0
        assert core_metric(text, "cpuinfer:engine_core_up", 1 - lost) == 1
        assert server.proc.poll() is None
        assert "Ray actor" in server.log() and "is gone" in server.log()
        print(f"node removed in {removed_in:.2f}s; its stream failed {failed_after:.2f}s after the removal began")

        assert server.stop() == 0
