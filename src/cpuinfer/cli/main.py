"""`cpuinfer <command>`: one subcommand per module, imported only when run."""

from __future__ import annotations

import importlib
import sys

from cpuinfer.cli.parser import Parser, chosen_parser

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
    parser = Parser(prog="cpuinfer", description="CPU-first LLM inference.")
    parser.add_argument("--version", action="version", version=f"cpuinfer {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    modules = {}
    for name, (module_name, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(p)
        modules[name] = module
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # named by the (sub)command's own parser, with its flags as suggestions
        chosen_parser(parser, args).error(f"unrecognized arguments: {' '.join(unknown)}")
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


def version() -> str:
    """The installed cpuinfer's version (the source tree's when it is not installed)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("cpuinfer")
    except PackageNotFoundError:
        try:
            from cpuinfer._version import version as v
        except ImportError:
            return "unknown (not installed)"
        return v


if __name__ == "__main__":
    sys.exit(main())
