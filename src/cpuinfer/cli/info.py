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


def run(args: argparse.Namespace) -> int:
    """Print the report; a dispatcher error is printed as one clear line."""
    import cpuinfer

    report = cpuinfer.info()
    if args.model:
        from cpuinfer.quantization.checkpoint import describe

        report["model"] = describe(args.model)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from cpuinfer._info import show

        print(show(report))
    return 0
