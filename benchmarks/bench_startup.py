"""Start-up: `cpuinfer generate` to its first token and `cpuinfer serve` to /health 200, against
`python -c "import torch"`, in fresh processes, interleaved so machine noise hits all alike.

    python benchmarks/bench_startup.py [--runs 3] [--kv-space 4]

Targets (issue 33, bundled SmolLM2-135M, default 4 GiB KV cache): first token <= 3 s after the process
starts (import included), /health 200 <= 5 s; peak resident memory of generate reflects the KV pages used,
not the cache's size. Prints absolute seconds and MB, and the ratios to torch's import.
"""

from __future__ import annotations

import argparse
import os
import resource
import socket
import statistics
import subprocess
import sys
import time

import httpx


def child_peak_rss_mb() -> float:
    """Largest peak RSS of the children waited for so far (Linux: KiB)."""
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024


def torch_import() -> float:
    """Seconds for a fresh interpreter to import torch and exit."""
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - t0


def first_token(env: dict) -> float:
    """Seconds from starting `cpuinfer generate` to its first byte of output."""
    cmd = [sys.executable, "-m", "cpuinfer", "generate", "Hello", "--max-tokens", "4", "--temperature", "0"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    proc.stdout.read(1)
    dt = time.perf_counter() - t0
    proc.stdout.read()
    proc.wait()
    return dt


def serve_ready(env: dict) -> float:
    """Seconds from starting `cpuinfer serve` to its first /health 200."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "cpuinfer", "serve", "--port", str(port)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        while proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - t0
            except httpx.HTTPError:
                pass  # not listening yet
            time.sleep(0.05)
        raise SystemExit(f"cpuinfer serve exited with {proc.returncode} before it was ready")
    finally:
        proc.terminate()
        proc.wait()


def main() -> int:
    """Time the three, print medians and ratios."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kv-space", default=None, help="VLLM_CPU_KVCACHE_SPACE for the runs (default: unset)")
    args = parser.parse_args()
    env = dict(os.environ)
    if args.kv_space is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = args.kv_space
    torch_t, gen_t, serve_t = [], [], []
    for _ in range(args.runs):
        torch_t.append(torch_import())
        gen_t.append(first_token(env))
        serve_t.append(serve_ready(env))
    base = statistics.median(torch_t)
    for name, times, target in (
        ("import torch", torch_t, None),
        ("generate: first token", gen_t, 3.0),
        ("serve: /health 200", serve_t, 5.0),
    ):
        med = statistics.median(times)
        verdict = "" if target is None else f"  target <= {target:g} s: {'OK' if med <= target else 'OVER'}"
        print(f"{name:24s} median {med:6.2f} s  ({med / base:4.1f}x import torch){verdict}")
    print(f"peak RSS of the children: {child_peak_rss_mb():.0f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
