"""Pipeline-parallel overlap: a two-stage step split into 2 micro-batches against the same step as 1, one run.

    python benchmarks/bench_pipeline.py [--model PATH] [--cpus 0,1] [--repeats 5]

Two ranks (one stage each, pinned to one CPU each, `VLLM_CPU_OMP_THREADS_BIND=a|b`), the bundled SmolLM2 in
bf16 by default. Each workload (a prefill of two 128-token prompts, a decode step of 16 sequences with 128
tokens of context) runs with CPUINFER_PP_MICRO_BATCHES=1 and =2 on fresh ranks (a fresh process each: rank 0
binds the process it runs in); prints the median step time
of each and their ratio. With perfect overlap and no transfer cost, 2 micro-batches take 3/4 of 1 (stage 0
runs the second micro-batch while stage 1 runs the first); 1.0 means no overlap.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

from cpuinfer.config import EngineArgs, default_model_path
from cpuinfer.engine.step import ScheduledSeq
from cpuinfer.worker.tp_executor import RankExecutor

BLOCK = 16


def workloads(vocab: int) -> dict[str, list[ScheduledSeq]]:
    """Steps, each with its own blocks: 2 prefills of 128 tokens; 16 decodes at position 128 (cache contents
    do not matter for timing)."""
    g = torch.Generator().manual_seed(0)

    def ids(n):
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    per = 128 // BLOCK + 1
    prefill = [ScheduledSeq(ids(128), 0, list(range(i * per, (i + 1) * per)), True) for i in range(2)]
    decode = [ScheduledSeq(ids(1), 128, list(range(i * per, (i + 1) * per)), True) for i in range(16)]
    return {"prefill 2 x 128": prefill, "decode 16 x 1 (ctx 128)": decode}


def time_steps(runner, seqs, repeats: int) -> float:
    """Median seconds of one step over `repeats` (after two warm-up steps)."""
    for _ in range(2):
        runner.execute(seqs)
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        runner.execute(seqs)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def measure(a) -> dict[str, float]:
    """Median step seconds of each workload with a.micro micro-batches (this process is rank 0)."""
    os.environ["CPUINFER_PP_MICRO_BATCHES"] = str(a.micro)  # read by every rank as it starts
    args = EngineArgs(
        model=a.model or default_model_path(),
        dtype="bfloat16",
        block_size=BLOCK,
        num_gpu_blocks_override=256,
        max_model_len=512,
        pipeline_parallel_size=2,
    )
    config = args.create_engine_config()
    runner = RankExecutor(config)
    try:
        return {name: time_steps(runner, seqs, a.repeats) for name, seqs in workloads(config.spec.vocab_size).items()}
    finally:
        runner.shutdown()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--cpus", default="0,1", help="the two CPUs of the two ranks")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--micro", type=int, default=0, help=argparse.SUPPRESS)  # one measurement, as a child
    a = p.parse_args()
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = a.cpus.replace(",", "|")
    if a.micro:
        print(json.dumps(measure(a)))
        return 0
    results = {}
    for micro in (1, 2):
        cmd = [sys.executable, __file__, "--cpus", a.cpus, "--repeats", str(a.repeats), "--micro", str(micro)]
        if a.model:
            cmd += ["--model", a.model]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
        results[micro] = json.loads(out.strip().splitlines()[-1])
    print(f"{'step':26s} {'1 micro-batch':>14s} {'2 micro-batches':>16s} {'ratio':>7s}")
    for name, one in results[1].items():
        two = results[2][name]
        print(f"{name:26s} {one * 1e3:11.1f} ms {two * 1e3:13.1f} ms {two / one:7.2f}")
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main())
