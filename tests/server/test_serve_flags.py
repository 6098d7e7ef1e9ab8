"""vLLM's flags as a vLLM user types them (issue 33): accepted with vLLM's meaning or refused with a hint;
no silent prefix matching; "did you mean"; --version; --chat-template paths; TLS, root path, request log."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from .conftest import running_server, server_env


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cpuinfer", *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=server_env(), timeout=timeout)


def test_version():
    out = cli("--version")
    assert out.returncode == 0 and out.stdout.startswith("cpuinfer ")


@pytest.mark.parametrize(
    "args, hint",
    [
        (["serve", "--max-num-seq", "4"], "--max-num-seq: did you mean --max-num-seqs?"),
        # --max-request-sequences is close too: it may be offered after the best match.
        (["serve", "--max-num-sqs=4"], "did you mean --max-num-seqs"),
        (["bench", "latency", "--input-lenn", "3"], "did you mean --input-len"),
    ],
)
def test_prefixes_are_refused_and_typos_get_suggestions(args, hint):
    out = cli(*args)
    assert out.returncode == 2
    assert "unrecognized arguments" in out.stderr and hint in out.stderr, out.stderr
    assert out.stderr.count("\n") <= 4  # a short paragraph, not the whole usage


def test_gpu_only_flags_are_refused_with_what_to_do_instead():
    out = cli("serve", "--gpu-memory-utilization", "0.9")
    assert out.returncode == 2 and "VLLM_CPU_KVCACHE_SPACE" in out.stderr


def test_a_chat_template_path_that_does_not_exist_is_an_error(tmp_path):
    missing = str(tmp_path / "template.jinja")
    out = cli("serve", "--chat-template", missing)
    assert out.returncode != 0 and f"--chat-template {missing!r}: no such file" in out.stderr


def test_bad_generation_config_and_tls_flags_fail_before_the_server_starts(tmp_path):
    out = cli("serve", "--generation-config", str(tmp_path))
    assert out.returncode != 0 and "--generation-config" in out.stderr
    out = cli("serve", "--ssl-keyfile", str(tmp_path / "k.pem"))
    assert out.returncode != 0 and "--ssl-certfile" in out.stderr
    assert "Uvicorn running" not in out.stdout + out.stderr


def test_vllm_flags_are_accepted_with_their_meaning(tmp_path):
    gen = tmp_path / "gen"
    gen.mkdir()
    (gen / "generation_config.json").write_text(json.dumps({"temperature": 0.0}))
    args = (
        "--enable-log-requests",
        "--max-log-len",
        "12",
        "--uvicorn-log-level",
        "warning",
        "--enforce-eager",
        "--enable-chunked-prefill",
        "--trust-remote-code",
        "--generation-config",
        str(gen),
    )
    with running_server(*args) as s:
        body = {"prompt": "Once upon a time", "max_tokens": 6}  # no temperature: generation_config.json's 0
        texts = {
            httpx.post(s.v1 + "/completions", json=body, headers=s.headers(), timeout=60).json()["choices"][0]["text"]
            for _ in range(3)
        }
        assert len(texts) == 1
        log = s.log()
    assert "Received request cmpl-" in log and "prompt: 'Once upon a ', params" in log  # --max-log-len 12
    assert "temperature=0.0" in log  # from --generation-config's generation_config.json
    assert "Uvicorn running" not in log  # uvicorn at warning level; cpuinfer's own lines still at info
    assert "engine ready" in log


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https_and_root_path(tmp_path):
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            key,
            "-out",
            cert,
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    flags = ("--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--root-path", "/llm")
    with running_server(*flags, wait=False) as server:
        url = "https" + server.url.removeprefix("http")
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and server.proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url + "/health", verify=False, timeout=2).status_code == 200:
                    break
            time.sleep(0.25)
        else:
            raise AssertionError(server.log())
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url + "/health", timeout=5)  # plain HTTP is not served
        spec = httpx.get(url + "/openapi.json", verify=False, headers=server.headers())
        assert spec.json()["servers"] == [{"url": "/llm"}]


def test_a_kv_cache_larger_than_memory_is_one_line_naming_the_variable():
    cmd = [sys.executable, "-m", "cpuinfer", "generate", "Hi", "--max-tokens", "1"]
    out = subprocess.run(
        cmd, capture_output=True, text=True, env=server_env(VLLM_CPU_KVCACHE_SPACE="100000"), timeout=120
    )
    assert out.returncode == 2
    assert "VLLM_CPU_KVCACHE_SPACE=100000 GiB" in out.stderr and "of memory available" in out.stderr
    assert "Traceback" not in out.stderr


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def test_request_preparation_workers_run_on_the_front_end_cores():
    """With a CPU reserved for the front end, the request-preparation workers run there too, not on the inference
    core: they come from a fork server started before the front end was pinned, and pin themselves."""
    from tests.cpus import machine_cpus

    if len(machine_cpus()) < 2:
        pytest.skip("needs two CPUs: one for the engine, one reserved for the front end")
    with running_server(env=server_env(VLLM_CPU_NUM_OF_RESERVED_CPU="1")) as s:
        front = os.sched_getaffinity(s.proc.pid)
        servers = [c for c in _children(s.proc.pid) if b"forkserver" in Path(f"/proc/{c}/cmdline").read_bytes()]
        assert len(servers) == 1, servers
        workers = _children(servers[0])
        assert len(workers) == 2, workers  # --request-prep-workers' default
        assert [os.sched_getaffinity(w) for w in workers] == [front, front]
        assert front < set(machine_cpus()), f"the front end ({front}) was not pinned off the engine's core"
        r = httpx.post(
            s.v1 + "/chat/completions",
            json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
            headers=s.headers(),
            timeout=60,
        )
        assert r.status_code == 200, r.text
