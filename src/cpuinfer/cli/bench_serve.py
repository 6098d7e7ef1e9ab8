"""`cpuinfer bench serve`: vLLM's serving benchmark (`vllm bench serve`) against a running OpenAI-compatible
server: cpuinfer, vLLM or llama-server, so that they can be compared with one tool.

Prompts come from vLLM's random dataset (token ids of a fixed length, sent as ids so the length is exact) or
a ShareGPT-format JSON file (the first human turn of each conversation; the answer's length, or
--sharegpt-output-len, as the output length). Requests are streamed completions with ignore_eos, sent with
Poisson arrivals at --request-rate (gamma with --burstiness) and at most --max-concurrency at once. The report
has vLLM's layout and names: request / token throughput, TTFT, TPOT (excluding the first token), ITL and
end-to-end latency (mean, median, percentiles), goodput under --goodput SLOs; --save-result writes it as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass

from cpuinfer.cli.bench_serve_report import (
    RequestResult,
    SpecCounters,
    parse_goodput,
    print_report,
    spec_decode_summary,
    summarize,
)


@dataclass
class BenchRequest:
    """One prompt to send: token ids or text, and how many tokens to ask for."""

    prompt: list[int] | str
    output_len: int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """vLLM's `bench serve` flags."""
    parser.add_argument("--base-url", default=None, help="server URL (default: http://HOST:PORT)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions", help="the completions route to call")
    parser.add_argument("--model", default=None, help="model name to send (default: the server's first model)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    parser.add_argument("--dataset-name", default="random", choices=["random", "sharegpt"])
    parser.add_argument("--dataset-path", default=None, help="ShareGPT-format JSON file (for --dataset-name sharegpt)")
    parser.add_argument("--num-prompts", type=int, default=1000)
    parser.add_argument("--random-input-len", type=int, default=1024)
    parser.add_argument("--random-output-len", type=int, default=128)
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths drawn uniformly from [len * (1 - r), len * (1 + r)]",
    )
    parser.add_argument(
        "--random-vocab-range",
        type=int,
        nargs=2,
        default=[1000, 20000],
        metavar=("LOW", "HIGH"),
        help="token ids of random prompts are drawn from [LOW, HIGH) (keep HIGH within the model's vocabulary)",
    )
    parser.add_argument("--sharegpt-output-len", type=int, default=None, help="output length of every ShareGPT prompt")
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrivals (1: Poisson)")
    parser.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    parser.add_argument("--percentile-metrics", default="ttft,tpot,itl", help="metrics to report percentiles of")
    parser.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles, e.g. 50,90,99")
    parser.add_argument(
        "--goodput",
        nargs="+",
        default=None,
        metavar="METRIC:MS",
        help="SLOs a request must meet to count for goodput, e.g. ttft:500 tpot:50 (metrics: ttft, tpot, e2el)",
    )
    parser.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-warmups", type=int, default=1, help="requests sent (and not counted) before the run")
    parser.add_argument("--save-result", action="store_true", help="write the results as JSON")
    parser.add_argument("--result-dir", default=".", help="directory of the --save-result file")
    parser.add_argument("--result-filename", default=None, help="name of the --save-result file")


def random_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """vLLM's random dataset: random token ids (lengths spread by --random-range-ratio)."""
    rng = random.Random(args.seed)
    low, high = args.random_vocab_range
    r = args.random_range_ratio

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - r)), int(n * (1 + r)))) if r else n

    return [
        BenchRequest(
            [rng.randrange(low, high) for _ in range(length(args.random_input_len))], length(args.random_output_len)
        )
        for _ in range(args.num_prompts)
    ]


def sharegpt_requests(args: argparse.Namespace, count_tokens) -> list[BenchRequest]:
    """The first human turn of each ShareGPT conversation; its answer's length in tokens as output length."""
    if not args.dataset_path:
        raise ValueError("--dataset-name sharegpt needs --dataset-path FILE.json")
    with open(args.dataset_path, encoding="utf-8") as f:
        data = json.load(f)
    rng = random.Random(args.seed)
    rng.shuffle(data)
    out = []
    for entry in data:
        turns = entry.get("conversations") or entry.get("conversation") or []
        if len(turns) < 2:
            continue
        prompt, answer = turns[0].get("value", ""), turns[1].get("value", "")
        n = args.sharegpt_output_len or count_tokens(answer)
        if prompt and n >= 1:
            out.append(BenchRequest(prompt, n))
        if len(out) == args.num_prompts:
            break
    if not out:
        raise ValueError(f"{args.dataset_path}: no conversation with a prompt and an answer (ShareGPT format)")
    return out


async def one_request(
    client, url: str, model: str, req: BenchRequest, ignore_eos: bool, headers: dict
) -> RequestResult:
    """Send one streaming completion and time every chunk that carries text."""
    import httpx

    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.output_len,
        "temperature": 0.0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    res = RequestResult(prompt_len=len(req.prompt) if isinstance(req.prompt, list) else 0)
    chunks = 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if chunk.get("error"):
                    res.error = str(chunk["error"])[:300]
                    return res
                usage = chunk.get("usage") or {}
                if usage.get("completion_tokens"):
                    res.output_tokens = usage["completion_tokens"]
                if usage.get("prompt_tokens"):
                    res.prompt_len = usage["prompt_tokens"]
                choices = chunk.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue
                chunks += 1
                now = time.perf_counter()
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
        res.latency = time.perf_counter() - start
        res.output_tokens = res.output_tokens or chunks  # a server that reports no usage: one token a chunk
        res.ok = True
    except (httpx.HTTPError, ValueError, KeyError) as e:  # a failed request is reported, not fatal
        res.error = repr(e)
    return res


async def run_benchmark(args, url: str, model: str, requests: list[BenchRequest], headers: dict):
    """Send every request with gamma (Poisson) arrivals; returns (results, duration in s)."""
    import httpx
    import numpy as np

    rng = np.random.default_rng(args.seed)
    sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    limits = httpx.Limits(max_connections=(args.max_concurrency or len(requests)) + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def send(req: BenchRequest) -> RequestResult:
            if sem is None:
                return await one_request(client, url, model, req, args.ignore_eos, headers)
            async with sem:
                return await one_request(client, url, model, req, args.ignore_eos, headers)

        for req in requests[: args.num_warmups]:
            await one_request(client, url, model, BenchRequest(req.prompt, min(req.output_len, 4)), True, headers)
        tasks = []
        start = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(send(req)))
            if args.request_rate != float("inf"):
                theta = 1.0 / (args.request_rate * args.burstiness)
                await asyncio.sleep(float(rng.gamma(args.burstiness, theta)))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def check_arguments(args: argparse.Namespace) -> None:
    """Bad values are a ValueError naming the flag."""
    for name in ("num_prompts", "random_input_len", "random_output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be >= 1")
    if not args.request_rate > 0 or not args.burstiness > 0:
        raise ValueError("--request-rate and --burstiness must be > 0")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency={args.max_concurrency} must be >= 1")
    if not 0 <= args.random_range_ratio < 1:
        raise ValueError(f"--random-range-ratio={args.random_range_ratio} must be in [0, 1)")
    low, high = args.random_vocab_range
    if not 0 <= low < high:
        raise ValueError(f"--random-vocab-range {low} {high}: need 0 <= LOW < HIGH")
    unknown = set(args.percentile_metrics.split(",")) - {"ttft", "tpot", "itl", "e2el"}
    if unknown:
        raise ValueError(f"--percentile-metrics: unknown {', '.join(sorted(unknown))} (ttft, tpot, itl, e2el)")
    try:
        [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        raise ValueError(f"--metric-percentiles {args.metric_percentiles!r}: give numbers such as 50,90,99") from None
    if "completions" not in args.endpoint or "chat" in args.endpoint:
        raise ValueError(f"--endpoint {args.endpoint}: only the completions route (/v1/completions) is benchmarked")


def run(args: argparse.Namespace) -> int:
    """Run the benchmark, print the report, optionally save it; exit 1 if any request failed."""
    import httpx

    try:
        check_arguments(args)
        slos = parse_goodput(args.goodput)
    except ValueError as e:
        sys.stderr.write(f"cpuinfer bench serve: {e}\n")
        return 2
    base = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        model = args.model or httpx.get(base + "/v1/models", headers=headers, timeout=30).json()["data"][0]["id"]
        if args.dataset_name == "random":
            requests = random_requests(args)
        else:
            requests = sharegpt_requests(args, lambda text: _count_tokens(base, model, text, headers))
    except (httpx.HTTPError, ValueError, KeyError, OSError) as e:
        sys.stderr.write(f"cpuinfer bench serve: {e}\n")
        return 2
    before = _spec_counters(base, headers)
    results, duration = asyncio.run(run_benchmark(args, base + args.endpoint, model, requests, headers))
    summary = summarize(args, results, duration, slos)
    after = _spec_counters(base, headers)
    if before is not None and after is not None:
        summary |= spec_decode_summary(before, after)
    print_report(args, summary)
    if args.save_result:
        name = (
            args.result_filename or f"cpuinfer-{args.request_rate}qps-{model.replace('/', '-')}-{summary['date']}.json"
        )
        path = os.path.join(args.result_dir, name)
        with open(path, "w") as f:
            json.dump({"model_id": model, "base_url": base, "num_prompts": len(requests), **summary}, f, indent=2)
        print(f"results written to {path}")
    return 0 if summary["failed"] == 0 else 1


def _spec_counters(base: str, headers: dict) -> SpecCounters | None:
    """The server's speculative-decoding counters from its /metrics; None where it has none (or no /metrics)."""
    import httpx

    try:
        r = httpx.get(base + "/metrics", headers=headers, timeout=30)
        return SpecCounters.from_prometheus(r.text) if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def _count_tokens(base: str, model: str, text: str, headers: dict) -> int:
    """Tokens of `text` by the server's /tokenize (vLLM's and cpuinfer's); a 4-characters-a-token guess elsewhere."""
    import httpx

    try:
        r = httpx.post(base + "/tokenize", json={"model": model, "prompt": text}, headers=headers, timeout=30)
        return int(r.json()["count"])
    except (httpx.HTTPError, ValueError, KeyError):
        return max(1, len(text) // 4)
