"""Serving benchmark for `cpuinfer serve` (or any OpenAI-compatible server, e.g. `vllm serve`).

Modelled on vLLM's benchmarks/benchmark_serving.py so numbers can be put side
by side: random prompts of a fixed token length, Poisson arrivals at each
request rate of a sweep, streaming completions with ignore_eos, and the same
report (request/token throughput, TTFT, TPOT, ITL mean/median/p99).

    # against a running server (vLLM or cpuinfer):
    python benchmarks/bench_serving.py --base-url http://127.0.0.1:8000 --request-rate 1 4 inf
    # without --base-url it starts `cpuinfer serve` (bundled SmolLM2) on a free loopback port itself:
    python benchmarks/bench_serving.py --num-prompts 16 --request-rate 2 inf
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time

import httpx

from cpuinfer.cli.bench_serve import BenchRequest, run_benchmark
from cpuinfer.cli.bench_serve_report import RequestResult
from cpuinfer.cli.bench_serve_report import summarize as bench_summarize


def bench_args(rate: float, max_concurrency: int | None = None, seed: int = 0, percentiles=(99,)):
    """The fields of `cpuinfer bench serve`'s arguments that its client and summary read."""
    return argparse.Namespace(
        request_rate=rate,
        burstiness=1.0,
        max_concurrency=max_concurrency,
        seed=seed,
        ignore_eos=True,
        num_warmups=0,
        metric_percentiles=",".join(f"{p:g}" for p in percentiles),
    )


async def run_rate(
    base_url: str,
    model: str,
    prompts: list[list[int]],
    output_len: int,
    rate: float,
    max_concurrency: int | None,
    api_key: str | None,
    seed: int,
) -> tuple[list[RequestResult], float]:
    """Send every prompt with Poisson arrivals at `rate` req/s (inf = all at once)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    requests = [BenchRequest(p, output_len) for p in prompts]
    url = base_url.rstrip("/") + "/v1/completions"
    return await run_benchmark(bench_args(rate, max_concurrency, seed), url, model, requests, headers)


def summarize(results: list[RequestResult], duration: float, rate: float, percentiles: list[float]) -> dict:
    """vLLM's metrics: throughput, TTFT, TPOT (excluding the first token), ITL."""
    return bench_summarize(bench_args(rate, percentiles=percentiles), results, duration, {})


def print_report(s: dict, percentiles: list[float]) -> None:
    """The same layout as vLLM's benchmark_serving."""
    rate = "inf" if s["request_rate"] == float("inf") else f"{s['request_rate']:g}"
    print("{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    rows = [
        ("Request rate (req/s):", rate),
        ("Successful requests:", s["completed"]),
        ("Failed requests:", s["failed"]),
        ("Benchmark duration (s):", f"{s['duration']:.2f}"),
        ("Total input tokens:", s["total_input_tokens"]),
        ("Total generated tokens:", s["total_output_tokens"]),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total Token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
    ]
    for k, v in rows:
        print(f"{k:<40} {v:<10}")
    for name, title in (
        ("ttft", "Time to First Token"),
        ("tpot", "Time per Output Token (excl. 1st token)"),
        ("itl", "Inter-token Latency"),
    ):
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        print(f"{'Mean ' + name.upper() + ' (ms):':<40} {s[f'mean_{name}_ms']:<10.2f}")
        print(f"{'Median ' + name.upper() + ' (ms):':<40} {s[f'median_{name}_ms']:<10.2f}")
        for p in percentiles:
            print(f"{f'P{p:g} ' + name.upper() + ' (ms):':<40} {s[f'p{p:g}_{name}_ms']:<10.2f}")
    print("=" * 50)


def launch_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    """Start `cpuinfer serve` on a free loopback port and wait until healthy."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "cpuinfer",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--disable-log-requests",
        *extra,
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"cpuinfer serve exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("cpuinfer serve did not become healthy within 300 s")


def main(argv: list[str] | None = None) -> int:
    """Run the sweep and print one report per request rate."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--base-url",
        default=None,
        help="URL of a running server; without it, `cpuinfer serve` is started on a free loopback port",
    )
    ap.add_argument("--server-args", default="", help="extra flags for the launched server (one string)")
    ap.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--random-input-len", type=int, default=64)
    ap.add_argument("--random-output-len", type=int, default=16)
    ap.add_argument(
        "--request-rate",
        type=float,
        nargs="+",
        default=[float("inf")],
        help="request rates to sweep, req/s (inf = all at once)",
    )
    ap.add_argument("--max-concurrency", type=int, default=None)
    ap.add_argument("--percentiles", type=float, nargs="+", default=[99], help="as vLLM's --metric-percentiles")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    ap.add_argument("--result-file", default=None, help="write every summary as JSON here")
    args = ap.parse_args(argv)

    proc = None
    base_url = args.base_url
    if base_url is None:
        proc, base_url = launch_server(args.server_args.split())
    try:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = args.model or httpx.get(base_url + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        rng = random.Random(args.seed)
        # Random token ids (as vLLM's random dataset), sent as ids so the input length is exact.
        prompts = [[rng.randrange(1000, 20000) for _ in range(args.random_input_len)] for _ in range(args.num_prompts)]
        asyncio.run(run_rate(base_url, model, prompts[:2], 4, float("inf"), None, args.api_key, 0))  # warm-up
        summaries = []
        for rate in args.request_rate:
            results, duration = asyncio.run(
                run_rate(
                    base_url,
                    model,
                    prompts,
                    args.random_output_len,
                    rate,
                    args.max_concurrency,
                    args.api_key,
                    args.seed,
                )
            )
            s = summarize(results, duration, rate, args.percentiles)
            print_report(s, args.percentiles)
            summaries.append(s)
        if args.result_file:
            with open(args.result_file, "w") as f:
                json.dump(
                    {
                        "model": model,
                        "base_url": base_url,
                        "args": vars(args) | {"api_key": None},
                        "results": summaries,
                    },
                    f,
                    indent=2,
                    default=str,
                )
        return 0 if all(s["failed"] == 0 for s in summaries) else 1
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    sys.exit(main())
