"""`cpuinfer generate "prompt"`: generate from one prompt, streaming the text to the terminal."""

from __future__ import annotations

import argparse
import sys
import time

from cpuinfer.cli._common import add_sampling_arguments, make_engine, sampling_params, stream_request
from cpuinfer.config import EngineArgs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `cpuinfer generate`."""
    parser.add_argument("prompt", help="Text to continue (use --chat to send it as a chat message).")
    parser.add_argument("--chat", action="store_true", help="Wrap the prompt in the model's chat template.")
    parser.add_argument("--stats", action="store_true", help="Print tokens/s afterwards (on stderr).")
    add_sampling_arguments(parser)
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    """Load the model, stream the completion."""
    engine = make_engine(args)
    prompt = args.prompt
    if args.chat:
        text, ids = engine.config.spec.encode_chat([{"role": "user", "content": prompt}])
        prompt = {"prompt": text, "prompt_token_ids": ids}
    try:
        params = sampling_params(args, engine.config.spec.generation_defaults)
        t0 = time.perf_counter()
        stream_request(engine, "0", prompt, params)
    except ValueError as exc:
        sys.stderr.write(f"\ncpuinfer: {exc}\n")
        return 2
    sys.stdout.write("\n")
    if args.stats:
        s = engine.get_stats()
        dt = time.perf_counter() - t0
        sys.stderr.write(f"{s.generation_tokens} tokens in {dt:.2f} s: {s.generation_tokens / dt:.1f} tokens/s\n")
    return 0
