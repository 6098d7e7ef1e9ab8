"""`cpuinfer info`: what was detected and chosen, and why."""

from __future__ import annotations

import argparse
import json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `cpuinfer info`."""
    parser.add_argument("--json", action="store_true", help="print the report as JSON")


def run(args: argparse.Namespace) -> int:
    """Print the report; a dispatcher error is printed as one clear line."""
    import cpuinfer

    report = cpuinfer.info()
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        from cpuinfer._info import show

        print(show(report))
    return 0

