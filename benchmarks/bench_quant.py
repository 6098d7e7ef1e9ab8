"""Quantized models against our own bf16 on the same GGUF, measured in the same run; prints ratios.

    python benchmarks/bench_quant.py [--model FILE.gguf]

Each configuration runs in its own process (peak RSS is per process), with bench_engine.py's loop:
W1 = batch 1, 128-token prompt, 128 greedy tokens (decode tok/s, prefill excluded); TTFT of a
512-token prompt; W2 = 32 prompts x 128 in x 128 out at once (output tok/s); peak RSS.
Configurations: `bf16` (the GGUF's quants dequantized: CPUINFER_GGUF_DEQUANTIZE=1) and `quant`
(kept quantized, the integer kernels). Targets of issue 12 measured here: Q4 W1 decode >= 2.5x our
own bf16; peak RSS <= 1.3 x file + KV cache + 300 MB. The llama.cpp comparisons of issue 12 need
llama-cpp-python, which this script does not build; they are not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys


def one(config: str, model: str) -> dict:
    """Measure one configuration in this process."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    if config == "bf16":
        os.environ["CPUINFER_GGUF_DEQUANTIZE"] = "1"
    else:
        os.environ.pop("CPUINFER_GGUF_DEQUANTIZE", None)
    from bench_engine import bench_engine

    args = argparse.Namespace(input_len=128, output_len=128, long_input_len=512, batch=32)
    return bench_engine(model, args)


def main() -> int:
    """Run every configuration in a subprocess and print the table and the ratios."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2 Q4_1)")
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--kv-space", default="0.5", help="VLLM_CPU_KVCACHE_SPACE for each run (GiB)")
    args, _ = ap.parse_known_args()  # nox passes its posargs to every benchmark
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_space)
    from cpuinfer.config import default_model_path

    model = args.model or default_model_path()
    if args.one:
        print(json.dumps(one(args.one, model)))
        return 0
    results = {}
    for config in ("bf16", "quant"):
        out = subprocess.run([sys.executable, __file__, "--one", config, "--model", model], check=True,
                             capture_output=True, text=True).stdout
        results[config] = json.loads(out.strip().splitlines()[-1])
    size_mb = os.path.getsize(model) / 2**20
    print(f"model {os.path.basename(model)} ({size_mb:.0f} MB)")
    print(f"{'config':<8}{'W1 decode tok/s':>17}{'TTFT 512 ms':>13}{'W2 tok/s':>10}{'weights MB':>12}"
          f"{'peak RSS MB':>13}")
    for config, r in results.items():
        print(f"{config:<8}{r['decode_tps']:>17.1f}{r['long_prefill'] * 1000:>13.0f}{r['throughput']:>10.1f}"
              f"{r['weights_mb']:>12.0f}{r['peak_rss_mb']:>13.0f}")
    q, b = results["quant"], results["bf16"]
    budget = 1.3 * size_mb + q["kv_mb"] + 300
    print(f"quant / bf16: W1 decode {q['decode_tps'] / b['decode_tps']:.2f}x (target >= 2.5 for Q4), "
          f"TTFT 512 {q['long_prefill'] / b['long_prefill']:.2f}x, W2 {q['throughput'] / b['throughput']:.2f}x")
    print(f"quant peak RSS {q['peak_rss_mb']:.0f} MB, budget {budget:.0f} MB (1.3 x file + KV {q['kv_mb']:.0f} + 300)")
    met = q["decode_tps"] >= 2.5 * b["decode_tps"] and q["peak_rss_mb"] <= budget
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
