"""`cpuinfer bench latency|throughput`: vLLM's offline benchmarks (random token prompts), printing tokens/s;
`cpuinfer bench serve`: its serving benchmark against a running server (bench_serve.py)."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time

from cpuinfer.cli._common import make_engine
from cpuinfer.cli.bench_serve_report import SpecCounters, print_spec_decode, spec_decode_summary
from cpuinfer.config import EngineArgs
from cpuinfer.sampling_params import SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """`bench latency` and `bench throughput` with vLLM's flag names."""
    from cpuinfer.cli import bench_serve

    sub = parser.add_subparsers(dest="bench", metavar="{latency,throughput,serve}", required=True)
    lat = sub.add_parser("latency", help="Time one batch end to end (prefill + decode).")
    lat.add_argument("--input-len", type=int, default=32)
    lat.add_argument("--output-len", type=int, default=128)
    lat.add_argument("--batch-size", type=int, default=8)
    lat.add_argument("--num-iters-warmup", type=int, default=2)
    lat.add_argument("--num-iters", type=int, default=5)
    lat.add_argument("--output-json", default=None, help="Write the results to this JSON file.")
    EngineArgs.add_cli_args(lat)
    thr = sub.add_parser("throughput", help="Generate for many prompts at once; tokens per second.")
    thr.add_argument("--input-len", type=int, default=128)
    thr.add_argument("--output-len", type=int, default=128)
    thr.add_argument("--num-prompts", type=int, default=100)
    thr.add_argument("--output-json", default=None, help="Write the results to this JSON file.")
    EngineArgs.add_cli_args(thr)
    srv = sub.add_parser("serve", help="Benchmark a running OpenAI-compatible server (as `vllm bench serve`).")
    bench_serve.add_arguments(srv)


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n random token-id prompts of `length` tokens (ids 1000.. to avoid special tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(n)]


def _run_batch(engine, prompts: list[list[int]], output_len: int) -> None:
    sp = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=output_len, ignore_eos=True)
    for p in prompts:
        engine.add_request(engine.next_request_id(), p, sp)
    while engine.has_unfinished_requests():
        engine.step()


def run(args: argparse.Namespace) -> int:
    """Run the chosen benchmark and print its numbers."""
    if args.bench == "serve":
        from cpuinfer.cli import bench_serve

        return bench_serve.run(args)
    for name in ("input_len", "output_len", "batch_size", "num_prompts", "num_iters"):
        v = getattr(args, name, 1)
        if v < 1:
            sys.stderr.write(f"cpuinfer: --{name.replace('_', '-')}={v} must be >= 1\n")
            return 2
    engine = make_engine(args)
    vocab = engine.config.spec.vocab_size
    if args.input_len + args.output_len > engine.core.max_model_len:
        sys.stderr.write(
            f"cpuinfer: --input-len + --output-len = {args.input_len + args.output_len} exceeds "
            f"max_model_len={engine.core.max_model_len}\n"
        )
        return 2
    if args.bench == "latency":
        prompts = random_prompts(args.batch_size, args.input_len, vocab)
        for _ in range(args.num_iters_warmup):
            _run_batch(engine, prompts, args.output_len)
        times = []
        before = SpecCounters.from_stats(engine.core.stats())
        for _ in range(args.num_iters):
            engine.core.pool.reset_prefix_cache()  # every iteration computes its prefill
            t0 = time.perf_counter()
            _run_batch(engine, prompts, args.output_len)
            times.append(time.perf_counter() - t0)
        times.sort()
        avg = sum(times) / len(times)
        out_tps = args.batch_size * args.output_len / avg
        print(f"Avg latency: {avg:.4f} seconds")
        for pct in (10, 25, 50, 75, 90, 99):
            print(f"{pct}% percentile latency: {times[min(len(times) - 1, len(times) * pct // 100)]:.4f} seconds")
        print(f"Output tokens/s: {out_tps:.2f}")
        result = {"avg_latency": avg, "latencies": times, "output_tokens_per_second": out_tps}
    else:
        prompts = random_prompts(args.num_prompts, args.input_len, vocab)
        before = SpecCounters.from_stats(engine.core.stats())
        t0 = time.perf_counter()
        _run_batch(engine, prompts, args.output_len)
        dt = time.perf_counter() - t0
        total = args.num_prompts * (args.input_len + args.output_len)
        out = args.num_prompts * args.output_len
        print(
            f"Throughput: {args.num_prompts / dt:.2f} requests/s, {total / dt:.2f} total tokens/s, "
            f"{out / dt:.2f} output tokens/s"
        )
        result = {
            "elapsed_time": dt,
            "num_requests": args.num_prompts,
            "total_num_tokens": total,
            "requests_per_second": args.num_prompts / dt,
            "tokens_per_second": total / dt,
            "output_tokens_per_second": out / dt,
        }
    spec = spec_decode_summary(before, SpecCounters.from_stats(engine.core.stats()))
    print_spec_decode(spec)
    result |= spec
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
