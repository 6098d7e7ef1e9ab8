"""Engine speed against transformers on SmolLM2 (bfloat16, same GGUF), measured in the same run; prints ratios.

    python benchmarks/bench_engine.py [--input-len 128 --output-len 128 --batch 32]

latency:    batch 1, input-len prompt, output-len new tokens; decode tokens/s (prefill excluded) and end to end;
            time to first token of an input-len and of a long-input-len prompt (each the median of --repeat
            prompts: a single one moved 20-30% between runs on a shared host).
throughput: `batch` prompts x input-len in x output-len out; output tokens/s.
memory:     peak RSS of the engine phase (run first, before transformers is loaded) against
            weights + KV space + 600 MB.
Targets: decode >= 3x transformers at batch 1, throughput >= 3x, RSS within budget (issue 4); time to
first token <= 0.75x transformers' at input-len 128 and <= 0.6x at 2048 (issue 11).
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import time

import torch


def rss_mb() -> float:
    """Peak resident set size of this process so far, in MB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    """Random token prompts (ids >= 1000 skip the special tokens)."""
    rng = random.Random(0)
    return [[rng.randrange(1000, vocab) for _ in range(length)] for _ in range(n)]


def bench_engine(model: str, args) -> dict:
    """Latency and throughput of cpuinfer's LLMEngine."""
    from cpuinfer.config import EngineArgs
    from cpuinfer.engine.llm_engine import LLMEngine
    from cpuinfer.sampling_params import SamplingParams

    t0 = time.perf_counter()
    eng = LLMEngine.from_engine_args(EngineArgs(model=model, dtype="bfloat16", enable_prefix_caching=False))
    load = time.perf_counter() - t0
    runner = eng.core.runner
    weights = sum(
        t.numel() * t.element_size() if isinstance(t, torch.Tensor) else t.nbytes for t in _tensors(runner.model)
    )
    kv = sum(k.numel() * k.element_size() * 2 for k, _ in runner.kv_caches)
    vocab = eng.config.spec.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)

    def run(ps):
        for p in ps:
            eng.add_request(eng.next_request_id(), p, sp)
        t = time.perf_counter()
        first = None
        while eng.has_unfinished_requests():
            eng.step()
            if first is None:
                first = time.perf_counter() - t
        return time.perf_counter() - t, first

    run(prompts(1, 16, vocab))  # warm-up
    total, prefill = run(prompts(1, args.input_len, vocab))
    decode_tps = (args.output_len - 1) / (total - prefill)
    one_sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)

    def ttft(length):
        times = []
        for p in prompts(args.repeat, length, vocab):
            eng.add_request(eng.next_request_id(), p, one_sp)
            t = time.perf_counter()
            while eng.has_unfinished_requests():
                eng.step()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    ttft_short, ttft_long = ttft(args.input_len), ttft(args.long_input_len)
    ttotal, _ = run(prompts(args.batch, args.input_len, vocab))
    return dict(
        load=load,
        latency=total,
        ttft=ttft_short,
        ttft_long=ttft_long,
        decode_tps=decode_tps,
        throughput=args.batch * args.output_len / ttotal,
        weights_mb=weights / 2**20,
        kv_mb=kv / 2**20,
        peak_rss_mb=rss_mb(),
    )


def _tensors(model):
    from cpuinfer.quantization import is_quantized

    seen = {}
    stack = [model]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            seen[obj.data_ptr()] = obj
        elif is_quantized(obj):  # counted whole (nbytes), not through its tensors
            seen[id(obj)] = obj
        elif isinstance(obj, (list, tuple)):
            stack.extend(obj)
        elif hasattr(obj, "__dict__") or hasattr(obj, "__slots__"):
            for name in getattr(obj, "__slots__", ()) or ():
                if hasattr(obj, name):
                    stack.append(getattr(obj, name))
            stack.extend(getattr(obj, "__dict__", {}).values())
    return seen.values()


def hf_model(model: str, overrides: dict | None = None):
    """transformers' model of the GGUF in bfloat16 (its default attention: SDPA), weights as cpuinfer loads them
    (overrides: config keys replaced, as the engine's hf_overrides)."""
    import transformers

    from cpuinfer.model_loader import load_model_spec, load_weights

    # The same GGUF, dequantized by cpuinfer's loader into Hugging Face names (transformers' own GGUF
    # loader needs `accelerate`; the weights are identical either way).
    spec = load_model_spec(model, "bfloat16", hf_overrides=overrides)
    config = transformers.AutoConfig.for_model(**{k: v for k, v in spec.hf_config.items() if k != "architectures"})
    m = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    tensors, _ = load_weights(spec)
    missing, unexpected = m.load_state_dict(tensors, strict=False)
    assert not unexpected and all("lm_head" in k or "rotary" in k for k in missing), (missing, unexpected)
    m.tie_weights()
    return m


def bench_transformers(model: str, args) -> dict:
    """The same measurements with transformers' generate (bfloat16, greedy, KV cache on)."""
    m = hf_model(model)
    vocab = m.config.vocab_size

    def gen(ps, n):
        ids = torch.tensor(ps)
        t = time.perf_counter()
        with torch.inference_mode():
            m.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        return time.perf_counter() - t

    gen(prompts(1, 16, vocab), 2)  # warm-up
    total = gen(prompts(1, args.input_len, vocab), args.output_len)

    def ttft(length):
        return statistics.median(gen([p], 1) for p in prompts(args.repeat, length, vocab))

    # Its decode rate is the run's time past the first token, taken as the median TTFT of that prompt length.
    ttft_short, ttft_long = ttft(args.input_len), ttft(args.long_input_len)
    ttotal = gen(prompts(args.batch, args.input_len, vocab), args.output_len)
    return dict(
        latency=total,
        ttft=ttft_short,
        ttft_long=ttft_long,
        decode_tps=(args.output_len - 1) / (total - ttft_short),
        throughput=args.batch * args.output_len / ttotal,
    )


def main() -> int:
    """Run both, print the numbers and the ratios."""
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file (default: the bundled SmolLM2)")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--long-input-len", type=int, default=2048, help="prompt length of the long-prompt TTFT")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3, help="prompts per time-to-first-token figure (the median)")
    ap.add_argument("--kv-space", default="0.5", help="VLLM_CPU_KVCACHE_SPACE for the run (GiB)")
    args, _ = ap.parse_known_args()  # nox passes its posargs to every benchmark
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", args.kv_space)
    # The bf16 engine against transformers' bf16: the GGUF's quants dequantized (bench_quant.py runs them quantized).
    os.environ.setdefault("CPUINFER_GGUF_DEQUANTIZE", "1")
    from cpuinfer.config import default_model_path

    model = args.model or default_model_path()
    print(
        f"model {os.path.basename(model)}, bfloat16, {torch.get_num_threads()} threads, "
        f"input {args.input_len}, output {args.output_len}, batch {args.batch}"
    )
    ours = bench_engine(model, args)
    budget = ours["weights_mb"] + ours["kv_mb"] + 600
    print(
        f"cpuinfer:     load {ours['load']:.1f}s  decode {ours['decode_tps']:.1f} "
        f"tok/s  throughput {ours['throughput']:.1f} tok/s  peak RSS {ours['peak_rss_mb']:.0f} MB "
        f"(budget {budget:.0f} = weights {ours['weights_mb']:.0f} + KV {ours['kv_mb']:.0f} + 600)"
    )
    ref = bench_transformers(model, args)
    print(f"transformers: decode {ref['decode_tps']:.1f} tok/s  throughput {ref['throughput']:.1f} tok/s")
    print(f"ratio decode (batch 1):   {ours['decode_tps'] / ref['decode_tps']:.2f}x  (target >= 3)")
    print(f"ratio throughput:         {ours['throughput'] / ref['throughput']:.2f}x  (target >= 3)")
    print(f"ratio end-to-end latency: {ref['latency'] / ours['latency']:.2f}x")
    print(
        f"TTFT {args.input_len} tokens:  ours {ours['ttft'] * 1000:.0f} ms, transformers "
        f"{ref['ttft'] * 1000:.0f} ms = {ours['ttft'] / ref['ttft']:.2f}x  (target <= 0.75; medians of {args.repeat})"
    )
    print(
        f"TTFT {args.long_input_len} tokens: ours {ours['ttft_long'] * 1000:.0f} ms, transformers "
        f"{ref['ttft_long'] * 1000:.0f} ms = {ours['ttft_long'] / ref['ttft_long']:.2f}x  (target <= 0.6)"
    )
    print(f"peak RSS within budget:   {ours['peak_rss_mb'] <= budget}")
    met = (
        ours["decode_tps"] >= 3 * ref["decode_tps"]
        and ours["throughput"] >= 3 * ref["throughput"]
        and ours["ttft"] <= 0.75 * ref["ttft"]
        and ours["ttft_long"] <= 0.6 * ref["ttft_long"]
        and ours["peak_rss_mb"] <= budget
    )
    return 0 if met else 1


if __name__ == "__main__":
    raise SystemExit(main())
