"""Quantized models against our own bf16 on the same GGUF, measured in the same run; prints ratios.

    python benchmarks/bench_quant.py [--model FILE.gguf]

Each configuration runs in its own process (peak RSS is per process), with bench_engine.py's loop:
W1 = batch 1, 128-token prompt, 128 greedy tokens (decode tok/s, prefill excluded); TTFT of a
512-token prompt; W2 = 32 prompts x 128 in x 128 out at once (output tok/s); peak RSS.
Configurations: `bf16` (the GGUF's quants dequantized: CPUINFER_GGUF_DEQUANTIZE=1), `quant`
(kept quantized, the integer kernels), and the same model as Hugging Face checkpoints `gptq4` (GPTQ
4 bit, group 128, act-order) and `w8a8` (compressed-tensors int8 per-channel weights, int8 dynamic
activations): converted from the GGUF by transformers and quantized by round to nearest with the
tests' helper (tests/models/quant_checkpoints.py, which needs transformers and compressed-tensors),
once, into --work-dir. Targets of issue 12 measured here: Q4 W1 decode >= 2.5x our
own bf16; peak RSS <= 1.3 x file + KV cache + 300 MB. The llama.cpp comparisons of issue 12 need
llama-cpp-python, which this script does not build; they are not measured here.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HF_FORMATS = {"gptq4": ("gptq", dict(bits=4, group=128, sym=True, act_order=True)),
              "w8a8": ("compressed-tensors", dict(scheme="W8A8"))}


def hf_checkpoint(config: str, gguf: str, work_dir: str) -> str:
    """The GGUF model as the HF checkpoint of an HF_FORMATS configuration (made once into work_dir)."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.models.quant_checkpoints import hf_from_gguf, quantize_dir

    base = os.path.join(work_dir, os.path.basename(gguf).removesuffix(".gguf"))
    hf, out = base + "-hf", f"{base}-{config}"
    if not os.path.isfile(os.path.join(hf, "config.json")):
        hf_from_gguf(gguf, hf)
    if not os.path.isfile(os.path.join(out, "config.json")):
        method, opts = HF_FORMATS[config]
        quantize_dir(hf, out, method, **opts)
    return out


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
    ap.add_argument("--configs", default="bf16,quant,gptq4,w8a8", help="comma-separated configurations to run")
    ap.add_argument("--work-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "cpuinfer-bench"),
                    help="where the gptq4 / w8a8 checkpoints are made (once)")
    args, _ = ap.parse_known_args()  # nox passes its posargs to every benchmark
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_space)
    from cpuinfer.config import default_model_path

    model = args.model or default_model_path()
    if args.one:
        print(json.dumps(one(args.one, model)))
        return 0
    results = {}
    for config in args.configs.split(","):
        path = hf_checkpoint(config, model, args.work_dir) if config in HF_FORMATS else model
        out = subprocess.run([sys.executable, __file__, "--one", config, "--model", path], check=True,
                             capture_output=True, text=True).stdout
        results[config] = json.loads(out.strip().splitlines()[-1])
    size_mb = os.path.getsize(model) / 2**20
    print(f"model {os.path.basename(model)} ({size_mb:.0f} MB)")
    print(f"{'config':<8}{'W1 decode tok/s':>17}{'TTFT 512 ms':>13}{'W2 tok/s':>10}{'weights MB':>12}"
          f"{'peak RSS MB':>13}")
    for config, r in results.items():
        print(f"{config:<8}{r['decode_tps']:>17.1f}{r['long_prefill'] * 1000:>13.0f}{r['throughput']:>10.1f}"
              f"{r['weights_mb']:>12.0f}{r['peak_rss_mb']:>13.0f}")
    if "quant" not in results or "bf16" not in results:
        return 0
    q, b = results["quant"], results["bf16"]
    for config in HF_FORMATS:
        if config in results:
            r = results[config]
            print(f"{config} / bf16: W1 decode {r['decode_tps'] / b['decode_tps']:.2f}x, "
                  f"TTFT 512 {r['long_prefill'] / b['long_prefill']:.2f}x, W2 {r['throughput'] / b['throughput']:.2f}x")
    budget = 1.3 * size_mb + q["kv_mb"] + 300
    print(f"quant / bf16: W1 decode {q['decode_tps'] / b['decode_tps']:.2f}x (target >= 2.5 for Q4), "
          f"TTFT 512 {q['long_prefill'] / b['long_prefill']:.2f}x, W2 {q['throughput'] / b['throughput']:.2f}x")
    print(f"quant peak RSS {q['peak_rss_mb']:.0f} MB, budget {budget:.0f} MB (1.3 x file + KV {q['kv_mb']:.0f} + 300)")
    met = q["decode_tps"] >= 2.5 * b["decode_tps"] and q["peak_rss_mb"] <= budget
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
