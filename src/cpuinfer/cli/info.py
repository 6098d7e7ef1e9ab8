"""`cpuinfer info`: what was detected and chosen, and why."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `cpuinfer info`."""
    parser.add_argument("--json", action="store_true", help="print the report as JSON")
    parser.add_argument(
        "--model",
        default=None,
        help="also say how this checkpoint (HF directory or .gguf file) is quantized and which kernel "
        "path its linear layers take",
    )
    parser.add_argument(
        "--layers",
        action="store_true",
        help="with --model: load it (bfloat16) and list each layer's plan: attention kind, MLP kind (dense or "
        "mixture of experts), weight format and the executor that runs it",
    )
    parser.add_argument(
        "-dp",
        "--data-parallel-size",
        type=int,
        default=1,
        help="also show where the ranks of this many data-parallel engine cores (serve -dp N) would run",
    )
    parser.add_argument(
        "-tp", "--tensor-parallel-size", type=int, default=1, help="... each core having this many ranks"
    )
    parser.add_argument(
        "-pp", "--pipeline-parallel-size", type=int, default=1, help="... times this many pipeline stages"
    )


def run(args: argparse.Namespace) -> int:
    """Print the report; a dispatcher error is printed as one clear line."""
    import cpuinfer

    report = cpuinfer.info()
    dp, tp, pp = args.data_parallel_size, args.tensor_parallel_size, args.pipeline_parallel_size
    if dp < 1 or tp < 1 or pp < 1:
        raise SystemExit(
            "cpuinfer info: --data-parallel-size, --tensor-parallel-size and --pipeline-parallel-size must be >= 1"
        )
    if dp * tp * pp > 1:
        from cpuinfer.platform.threads import layout_report

        report["layout"] = layout_report(world_sizes=[dp * tp * pp])
        # rank r is data-parallel rank r // (tp * pp); within its core, pipeline stage (r % (tp * pp)) // tp and
        # tensor-parallel rank r % tp
        report["layout"]["tensor_parallel_size"] = tp
        report["layout"]["pipeline_parallel_size"] = pp
        report["layout"]["data_parallel_size"] = dp
    if args.model:
        from cpuinfer.quantization.checkpoint import describe

        report["model"] = describe(args.model)
        if args.layers:
            report["model"]["layers"] = layer_plans(args.model)
    elif args.layers:
        raise SystemExit("cpuinfer info: --layers needs --model")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from cpuinfer._info import show

        print(show(report))
    return 0


def layer_plans(model: str) -> list[str]:
    """Each layer's plan in one line, consecutive equal layers merged ("layers 0-5: ...")."""
    import torch

    from cpuinfer.model_loader import load_model_spec
    from cpuinfer.models.plan import describe
    from cpuinfer.worker import ModelRunner

    runner = ModelRunner(load_model_spec(model, "bfloat16"), block_size=16, num_blocks=1, cache_dtype=torch.bfloat16)
    lines = [
        describe(layer.plan, "fused C++ layer" if layer.fused is not None else "Python reference executor")
        for layer in runner.model.layers
    ]
    out, start = [], 0
    for i in range(1, len(lines) + 1):
        if i == len(lines) or lines[i] != lines[start]:
            span = f"layer {start}" if i - 1 == start else f"layers {start}-{i - 1}"
            out.append(f"{span}: {lines[start]}")
            start = i
    return out
