"""Data parallelism: `cpuinfer serve -dp 2` against `-dp 1`, and the Ray backend's cost per token, in one run.

Every configuration serves the bundled SmolLM2 on the same CPUs (VLLM_CPU_OMP_THREADS_BIND: all of them for
one core, one share each for two), through bench_serving's client:
- throughput: --num-prompts random prompts, all at once (output tokens/s of the whole server);
- one stream: a single request alone, its mean inter-token latency (what a per-token overhead shows in).
The Ray configurations let the server start a local Ray cluster (`ray.init()` without RAY_ADDRESS), so their
difference from mp at the same -dp is the actor transport (put / take round trips) plus Ray's own processes.

    python benchmarks/bench_data_parallel.py                   # mp -dp 1 / 2, and ray if installed
    python benchmarks/bench_data_parallel.py --rounds 2        # alternate the configurations twice
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import random
import signal
import sys

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_serving import launch_server, run_rate, summarize


def configurations(cpus: list[int], with_ray: bool) -> list[tuple[str, list[str], dict]]:
    """(name, serve flags, environment) of each configuration."""
    both = f"{cpus[0]}-{cpus[-1]}" if cpus == list(range(cpus[0], cpus[-1] + 1)) else ",".join(map(str, cpus))
    half = len(cpus) // 2
    split = ",".join(map(str, cpus[:half])) + "|" + ",".join(map(str, cpus[half:]))
    out = [
        ("mp  -dp 1", ["-dp", "1"], {"VLLM_CPU_OMP_THREADS_BIND": both}),
        ("mp  -dp 2", ["-dp", "2"], {"VLLM_CPU_OMP_THREADS_BIND": split}),
    ]
    if with_ray:
        ray = ["--data-parallel-backend", "ray"]
        out += [
            ("ray -dp 1", [*ray, "-dp", "1"], {"VLLM_CPU_OMP_THREADS_BIND": both}),
            (
                "ray -dp 2",
                [*ray, "-dp", "2"],
                {"VLLM_CPU_OMP_THREADS_BIND": split, "CPUINFER_RAY_CPUS_PER_ENGINE": str(max(1, half))},
            ),
        ]
    return out


def measure(flags: list[str], env: dict, args) -> dict:
    """Start a server with `flags` / `env`, run both workloads, stop it."""
    saved = {k: os.environ.get(k) for k in [*env, "RAY_ADDRESS"]}
    os.environ.update(env)
    os.environ.pop("RAY_ADDRESS", None)
    try:
        proc, url = launch_server([*flags, "--max-model-len", "1024"])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    try:
        model = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(1000, 40000) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
        warm, _ = asyncio.run(run_rate(url, model, prompts[:4], 8, float("inf"), None, None, args.seed))
        assert all(r.ok for r in warm), [r.error for r in warm]
        results, duration = asyncio.run(
            run_rate(url, model, prompts, args.output_len, float("inf"), None, None, args.seed)
        )
        many = summarize(results, duration, float("inf"), [50])
        one, d1 = asyncio.run(run_rate(url, model, prompts[:1], args.stream_len, float("inf"), None, None, 0))
        single = summarize(one, d1, float("inf"), [50])
        return {
            "throughput": many["output_throughput"],
            "failed": many["failed"],
            "itl_ms": single["mean_itl_ms"],
            "stream_tok_s": single["output_throughput"],
        }
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except Exception:  # noqa: BLE001 - a server that hangs on exit is killed; the numbers stand
            proc.kill()


def main(argv: list[str] | None = None) -> int:
    """Run every configuration `--rounds` times, alternating, and print the ratios."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--stream-len", type=int, default=128, help="tokens of the lone stream")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--no-ray", action="store_true", help="skip the Ray configurations")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("needs at least 2 CPUs")
    with_ray = not args.no_ray and importlib.util.find_spec("ray") is not None
    configs = configurations(cpus, with_ray)
    found: dict[str, list[dict]] = {name: [] for name, _, _ in configs}
    for _ in range(args.rounds):
        for name, flags, env in configs:
            r = measure(flags, env, args)
            found[name].append(r)
            print(
                f"{name}: {r['throughput']:7.1f} output tok/s ({args.num_prompts} prompts at once, "
                f"{r['failed']} failed); one stream: {r['stream_tok_s']:6.1f} tok/s, ITL {r['itl_ms']:.2f} ms",
                flush=True,
            )

    def best(name: str, key: str, low: bool = False) -> float:
        values = [r[key] for r in found[name]]
        return min(values) if low else max(values)

    print(f"\nCPUs {cpus}; best of {args.rounds} round(s)")
    print(f"-dp 2 / -dp 1 throughput (mp):  {best('mp  -dp 2', 'throughput') / best('mp  -dp 1', 'throughput'):.2f}x")
    if with_ray:
        for dp in ("1", "2"):
            ratio = best(f"ray -dp {dp}", "throughput") / best(f"mp  -dp {dp}", "throughput")
            extra = best(f"ray -dp {dp}", "itl_ms", True) - best(f"mp  -dp {dp}", "itl_ms", True)
            print(f"ray / mp at -dp {dp}: throughput {ratio:.2f}x, one stream's ITL {extra:+.2f} ms per token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
