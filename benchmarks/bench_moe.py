"""Mixture-of-experts decode against the memory-bandwidth roofline and transformers, measured in one run.

    python benchmarks/bench_moe.py [--layers 12 --experts 64 --top-k 4 --hidden 1024 --moe-inter 384]

A Qwen3-MoE-shaped model with random weights (written by transformers, bfloat16; the default is ~1.9 GB,
larger than the last-level caches seen on these machines (up to 480 MB), with Qwen3-30B-A3B's proportions
scaled down: 64 experts, top 4, GQA 16/4 heads of 64, vocab 16k):
- batch-1 decode tokens/s, and the share of the read-bandwidth roofline over the bytes a token actually
  reads: the dense weights (attention, norms, routers, lm_head, one embedding row), each layer's top-k
  experts, and its KV cache (the bandwidth: a multithreaded streaming read measured here);
- 32-sequence throughput against transformers' batched `generate` (bfloat16, greedy, same model).
- llama.cpp on the same model (with --llama, the default where llama-cpp-python imports): the checkpoint
  written as GGUF by llama.cpp's own converter (convert_hf_to_gguf.py from the llama-cpp-python sdist, bf16),
  then Q8_0 (gguf-py's quantizer), Q4_K_M and MXFP4_MOE (llama.cpp's; the experts MXFP4, the rest Q8_0),
  each run by both engines on the same file through bench_quant.py's rows: batch-1 decode (W1), a long
  prompt's TTFT, and --batch sequences at once (W2).
Targets (issue 31): decode >= 70% of the roofline; 32-sequence throughput >= 3x transformers; on the GGUF
files, batch-1 decode >= 1.2x and 32-sequence throughput >= 1.5x llama.cpp.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import tempfile
import time

import torch
from llama_cpp_run import add_llama_args

# The CPUs this process may use, before the engine binds its threads: the engine pins this (main) thread to
# one CPU, and a child process inherits the affinity of the thread that starts it.
CPUS = sorted(os.sched_getaffinity(0))


def make_model(path: str, args) -> dict:
    """Write the random-weight checkpoint; return its config."""
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 3,
        moe_intermediate_size=args.moe_inter,
        num_hidden_layers=args.layers,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        num_experts=args.experts,
        num_experts_per_tok=args.top_k,
        norm_topk_prob=True,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    model.save_pretrained(path)
    return model


def read_bandwidth() -> float:
    """Bytes per second of a multithreaded streaming read (torch sum over 2 GiB, past any cache; best of 5)."""
    buf = torch.ones(512 << 20, dtype=torch.float32)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t)
    return buf.numel() * 4 / best


def bytes_per_token(runner, context: int) -> tuple[float, float]:
    """(weight bytes a batch-1 decode step reads, KV bytes at `context` tokens)."""
    from cpuinfer.models.plan import MoEMLP

    def nbytes(t) -> int:
        return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes

    total = 0
    for layer in runner.model.layers:
        p = layer.plan
        a, m = p.attn, p.mlp
        total += sum(nbytes(t) for t in (p.in_norm, p.post_attn_norm, a.qkv_w, a.o_w) if t is not None)
        if isinstance(m, MoEMLP):
            per_expert = nbytes(m.gate_up_w[0]) + nbytes(m.down_w[0])
            total += nbytes(m.router_w) + m.top_k * per_expert
        else:
            total += nbytes(m.gate_up_w) + nbytes(m.down_w)
    head = runner.model.head
    total += nbytes(head.lm_head) + head.lm_head.shape[-1] * 2  # and one embedding row
    # caches [blocks, kv heads, block size, head size]: a token's keys and values in every layer
    kv = sum(2 * k.shape[1] * k.shape[3] * k.element_size() for k, _ in runner.kv_caches)
    return total, kv * context


def bench_ours(path: str, args) -> dict:
    """cpuinfer's decode and throughput on the checkpoint."""
    from cpuinfer.config import EngineArgs
    from cpuinfer.engine.llm_engine import LLMEngine
    from cpuinfer.sampling_params import SamplingParams

    eng = LLMEngine.from_engine_args(EngineArgs(model=path, dtype="bfloat16", enable_prefix_caching=False))
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    rng = random.Random(0)

    def run(n):
        for _ in range(n):
            eng.add_request(eng.next_request_id(), [rng.randrange(10, args.vocab) for _ in range(args.input_len)], sp)
        t, first = time.perf_counter(), None
        while eng.has_unfinished_requests():
            eng.step()
            if first is None:
                first = time.perf_counter() - t
        return time.perf_counter() - t, first

    run(1)  # warm-up
    decode = []
    for _ in range(3):
        total, prefill = run(1)
        decode.append((args.output_len - 1) / (total - prefill))
    ttotal, _ = run(args.batch)
    weights, kv = bytes_per_token(eng.core.runner, args.input_len + args.output_len // 2)
    return dict(decode=max(decode), throughput=args.batch * args.output_len / ttotal, weights=weights, kv=kv)


def bench_transformers(model, args) -> float:
    """transformers' batched generate throughput (output tokens/s), the same prompts' shape."""
    rng = random.Random(0)
    ids = torch.tensor([[rng.randrange(10, args.vocab) for _ in range(args.input_len)] for _ in range(args.batch)])
    kw = dict(max_new_tokens=args.output_len, min_new_tokens=args.output_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        warm = {**kw, "max_new_tokens": 2, "min_new_tokens": 2}
        model.generate(ids[:1, :16], attention_mask=torch.ones_like(ids[:1, :16]), **warm)
        t = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
    return args.batch * args.output_len / (time.perf_counter() - t)


def llama_cpp_rows(path: str, args) -> int:
    """Convert the checkpoint with llama.cpp's converter, then run bench_quant.py's cpuinfer and llama.cpp rows on
    its Q8_0, Q4_K_M and MXFP4_MOE files; returns bench_quant's exit status (0: its targets met)."""
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path.insert(0, os.path.dirname(here))
    from tests.models.llama_cpp_convert import convert

    os.makedirs(args.work_dir, exist_ok=True)
    shape = f"qwen3moe-l{args.layers}-e{args.experts}k{args.top_k}-h{args.hidden}-i{args.moe_inter}-v{args.vocab}"
    gguf = os.path.join(args.work_dir, f"{shape}-bf16.gguf")
    if not os.path.isfile(gguf):
        convert(path, gguf + ".part", "bf16")
        os.replace(gguf + ".part", gguf)
    cmd = [sys.executable, os.path.join(here, "bench_quant.py"), "--model", gguf, "--configs", "q8_0,q4_k_m,mxfp4_moe"]
    cmd += ["--work-dir", args.work_dir, "--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    cmd += ["--batch", str(args.batch), "--long-input-len", "256", "--threads", str(len(CPUS))]
    if args.llama_python:
        cmd += ["--llama-python", args.llama_python]
    print(f"llama.cpp comparison on {gguf} (bench_quant.py rows):", flush=True)
    # Every CPU for the rows (the engine pinned this thread to one: the children would inherit that).
    return subprocess.run(cmd, preexec_fn=lambda: os.sched_setaffinity(0, CPUS)).returncode


def main() -> int:
    """Build the model, run both, print numbers and ratios."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--moe-inter", type=int, default=384)
    ap.add_argument("--vocab", type=int, default=16384)
    ap.add_argument("--input-len", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    add_llama_args(ap, "also compare with llama.cpp on GGUF files of the model")
    ap.add_argument(
        "--work-dir",
        default=os.path.join(os.path.expanduser("~"), ".cache", "cpuinfer-bench"),
        help="where the GGUF files are made (once per model shape)",
    )
    args, _ = ap.parse_known_args()  # nox passes its posargs to every benchmark
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "0.5")
    with tempfile.TemporaryDirectory() as path:
        model = make_model(path, args)
        size = sum(t.numel() * 2 for t in model.parameters()) / 2**20
        print(
            f"Qwen3-MoE-shaped: {args.layers} layers, {args.experts} experts top-{args.top_k}, hidden {args.hidden}, "
            f"expert intermediate {args.moe_inter}, {size:.0f} MB bf16; {torch.get_num_threads()} threads"
        )
        ours = bench_ours(path, args)
        llama_status = llama_cpp_rows(path, args) if args.llama else 0
    bw = read_bandwidth()
    step_bytes = ours["weights"] + ours["kv"]
    roofline = bw / step_bytes
    share = ours["decode"] / roofline
    print(
        f"batch-1 decode: {ours['decode']:.1f} tok/s; a token reads {step_bytes / 2**20:.1f} MB (weights "
        f"{ours['weights'] / 2**20:.1f}, KV {ours['kv'] / 2**20:.2f}); read bandwidth {bw / 1e9:.1f} GB/s -> "
        f"roofline {roofline:.1f} tok/s: {share:.0%} (target >= 70%)"
    )
    theirs = bench_transformers(model, args)
    ratio = ours["throughput"] / theirs
    print(
        f"{args.batch}-sequence throughput: ours {ours['throughput']:.1f} tok/s, transformers {theirs:.1f} tok/s = "
        f"{ratio:.2f}x (target >= 3)"
    )
    return 0 if share >= 0.7 and ratio >= 3 and llama_status == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
