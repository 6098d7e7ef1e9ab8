"""`cpuinfer <command>`: one subcommand per module, imported only when run."""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module with add_arguments(parser) and run(args) -> int
COMMANDS = {
    "info": ("cpuinfer.cli.info", "Show the detected CPU, the kernel variants and which one is used."),
    "generate": ("cpuinfer.cli.generate", "Generate from one prompt, streaming the text."),
    "chat": ("cpuinfer.cli.chat", "Chat with a model in the terminal."),
    "bench": ("cpuinfer.cli.bench", "Offline latency / throughput benchmarks (as vLLM's)."),
    "serve": ("cpuinfer.cli.serve", "Serve a model over an OpenAI-compatible HTTP API (like `vllm serve`)."),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `cpuinfer` console script."""
    parser = argparse.ArgumentParser(prog="cpuinfer", description="CPU-first LLM inference.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(p)
        modules[name] = module
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    try:
        return int(modules[args.command].run(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `cpuinfer info | head`: the reader left, which is fine
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
