"""A real `cpuinfer serve` subprocess on a free loopback port, one per test module.

Small on purpose so the server tests fit CI on 2 cores: the bundled
SmolLM2-135M, 0.5 GiB of KV cache, a short context.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

import httpx
import pytest

HOST = "127.0.0.1"  # loopback only, always
API_KEY = "test-key-123"
MAX_MODEL_LEN = 512
START_TIMEOUT = 300.0


def free_port() -> int:
    """A port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """A running server: its base URL, process and log file."""

    url: str
    proc: subprocess.Popen
    log_path: str
    api_key: str | None

    @property
    def v1(self) -> str:
        """Base URL of the OpenAI routes."""
        return self.url + "/v1"

    def log(self) -> str:
        """Everything the server printed so far."""
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def headers(self) -> dict:
        """Authorization header for /v1 routes."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def engine_pid(self) -> int:
        """Process id of the engine core (from the server's log)."""
        found = re.findall(r"engine core process pid (\d+)", self.log())
        assert found, "server did not log its engine core pid:\n" + self.log()[-3000:]
        return int(found[-1])

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait; returns the exit code (kills and fails on a hang)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"server did not exit within {timeout}s of SIGTERM:\n{self.log()[-3000:]}") from None


def server_env(**extra: str) -> dict:
    """The environment of a test server: small KV cache, no inherited API key."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_API_KEY", "CPUINFER_API_KEY")}
    env.update({"VLLM_CPU_KVCACHE_SPACE": "0.5", "PYTHONUNBUFFERED": "1"})
    env.update(extra)
    return env


@contextlib.contextmanager
def running_server(*args: str, api_key: str | None = API_KEY, env: dict | None = None, wait: bool = True):
    """Start `cpuinfer serve` with `args`; wait until /health says 200; stop it afterwards."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "cpuinfer",
        "serve",
        "--host",
        HOST,
        "--port",
        str(port),
        "--max-model-len",
        str(MAX_MODEL_LEN),
        *args,
    ]
    if api_key:
        cmd += ["--api-key", api_key]
    log = tempfile.NamedTemporaryFile("w", prefix="cpuinfer-serve-", suffix=".log", delete=False)  # noqa: SIM115 - the server writes it until it stops
    # Its own process group, like a server started from a shell: a Ctrl-C (SIGINT to the group) reaches the
    # front end and the engine core alike.
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env or server_env(), start_new_session=True)
    server = Server(f"http://{HOST}:{port}", proc, log.name, api_key)
    try:
        if wait:
            wait_healthy(server)
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()


def wait_healthy(server: Server, timeout: float = START_TIMEOUT) -> None:
    """Poll /health until 200 (fails if the process exits or the time runs out)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise AssertionError(f"server exited with {server.proc.returncode}:\n{server.log()[-5000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(server.url + "/health", timeout=2).status_code == 200:
                return
        time.sleep(0.25)
    raise AssertionError(f"server not healthy after {timeout}s:\n{server.log()[-5000:]}")


def metric(text: str, name: str) -> float:
    """The value of one (unlabelled-by-us) sample in a Prometheus exposition."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"metric {name} not found")


@pytest.fixture(scope="module")
def server():
    """One server per test module (API key required)."""
    with running_server() as s:
        yield s


@pytest.fixture(scope="module")
def model_name(server) -> str:
    """The name the server answers to."""
    r = httpx.get(server.v1 + "/models", headers=server.headers(), timeout=10)
    return r.json()["data"][0]["id"]
