"""Runs for test_tensor_parallel and test_pipeline_parallel, each in a fresh process
(`python -m tests.engine.tp_runs MODE ARGS`).

A tensor- or pipeline-parallel engine binds the process it runs in (rank 0) to its cores, so the test process
itself never hosts one. Each run prints one JSON line with what the test compares. The last argument is the
ranks: "2" (tensor-parallel size) or "2x3" (tensor x pipeline-parallel size).
"""

from __future__ import annotations

import json
import sys

import torch

PROMPTS = [
    [5, 17, 99, 3, 250, 41, 7, 7, 8, 120, 33, 2, 64, 91, 11, 200, 19, 45, 61, 72],
    list(range(30, 67)),
    [9, 8, 7],
]


def ranks(size: str) -> tuple[int, int]:
    """(tensor-parallel, pipeline-parallel size) of "2" or "2x3"."""
    tp, _, pp = size.partition("x")
    return int(tp), int(pp or 1)


def runner_greedy(path: str, dtype: str, tp: int, pp: int = 1) -> dict:
    """greedy() (tests/models/greedy.py: chunked prefill mixed with decodes, shuffled block tables) on a
    ModelRunner (one rank) or a RankExecutor; tokens and first-token logits."""
    from cpuinfer.config import EngineArgs
    from tests.models.greedy import greedy

    args = EngineArgs(
        model=path,
        dtype=dtype,
        block_size=16,
        num_gpu_blocks_override=64,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
    )
    runner = build(args)
    tokens, first = greedy(runner, PROMPTS, 24, batched=True, chunk=7)
    fused = [getattr(layer, "fused", None) is not None for layer in runner_model(runner).layers]
    close(runner)
    return {"tokens": tokens, "first": [f.tolist() for f in first], "fused": fused}


def build(args):
    """The runner the engine core would use for these args (the product's build_runner: ModelRunner or
    RankExecutor), bound as the test's VLLM_CPU_OMP_THREADS_BIND says."""
    from cpuinfer.worker.tp_executor import build_runner

    return build_runner(args.create_engine_config())[0]


def close(runner) -> None:
    """Stop a RankExecutor's workers (a ModelRunner has none)."""
    if hasattr(runner, "shutdown"):
        runner.shutdown()


def runner_model(runner):
    return getattr(runner, "runner", runner).model


def engine_greedy(path: str, dtype: str, kv: str, tp: int, pp: int = 1, speculative: dict | None = None) -> dict:
    """The whole engine (LLM): prefix caching on shared prefixes, prefill chunked by a small token budget,
    preemption from a small KV pool, speculative decoding if given; greedy token ids and the number of
    preemptions."""
    from cpuinfer import LLM, SamplingParams

    shared = list(range(100, 140))  # 40 tokens: two full 16-token blocks shared by the first prompts
    prompts = [[*shared, 1, 2, 3], [*shared, 4, 5], [7, 8, 9, 10] * 6, list(range(200, 233)), [11, 12, 13]]
    llm = LLM(
        model=path,
        dtype=dtype,
        kv_cache_dtype=kv,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        block_size=16,
        num_gpu_blocks_override=14,  # 224 tokens for 5 sequences of up to 75: some must wait or be preempted
        max_model_len=128,
        max_num_batched_tokens=32,
        enable_prefix_caching=True,
        speculative_config=speculative,
    )
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    return {
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "preemptions": stats.num_preemptions,
        "prefix_hits": stats.prefix_cache_hits,
        "accepted": stats.spec_decode_num_accepted_tokens,
    }


def smol_tp3(path: str, tp: int) -> dict:
    """The bundled SmolLM2 Q4_1 GGUF (9 heads, 3 KV heads) on tp ranks in bf16: first-token logits of two
    prompts, and whether every projection stayed quantized (its shares cut in the packed layout)."""
    from cpuinfer.config import EngineArgs
    from cpuinfer.quantization import is_quantized
    from tests.models.greedy import greedy

    args = EngineArgs(
        model=path,
        dtype="bfloat16",
        block_size=16,
        num_gpu_blocks_override=16,
        max_model_len=256,
        tensor_parallel_size=tp,
    )
    runner = build(args)
    prompts = [runner.spec.tokenizer.encode(p).ids for p in ("The capital of France is", "def fibonacci(n):")]
    tokens, first = greedy(runner, prompts, 4, batched=True, chunk=5)
    model = runner_model(runner)
    weights = [
        w
        for layer in model.layers
        for w in (layer.plan.attn.qkv_w, layer.plan.attn.o_w, layer.plan.mlp.gate_up_w, layer.plan.mlp.down_w)
    ]
    quantized = all(is_quantized(w) for w in weights) and is_quantized(model.head.lm_head)
    close(runner)
    return {"tokens": tokens, "first": [f.tolist() for f in first], "quantized": quantized}


def main() -> None:
    torch.set_num_threads(1)
    mode, *args = sys.argv[1:]
    if mode == "runner":
        path, dtype, size = args
        print(json.dumps(runner_greedy(path, dtype, *ranks(size))))
    elif mode == "smol":
        path, tp = args
        print(json.dumps(smol_tp3(path, int(tp))))
    elif mode == "engine":
        path, dtype, kv, *speculative, size = args  # the ranks stay last (test_tensor_parallel.run reads them)
        spec = json.loads(speculative[0]) if speculative else None
        print(json.dumps(engine_greedy(path, dtype, kv, *ranks(size), speculative=spec)))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
