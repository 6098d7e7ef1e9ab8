"""`cpuinfer chat`: an interactive chat with the model in the terminal (Ctrl-D or /exit to leave)."""

from __future__ import annotations

import argparse
import sys

from cpuinfer.cli._common import add_sampling_arguments, make_engine, sampling_params, stream_request
from cpuinfer.config import EngineArgs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `cpuinfer chat`."""
    parser.add_argument("--system", default=None, help="System message that opens the conversation.")
    add_sampling_arguments(parser, max_tokens=512)
    EngineArgs.add_cli_args(parser)


def run(args: argparse.Namespace) -> int:
    """Read a line, answer it, repeat."""
    engine = make_engine(args)
    spec = engine.config.spec
    messages = [{"role": "system", "content": args.system}] if args.system else []
    interactive = sys.stdin.isatty()
    turn = 0
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        if line.strip() in ("/exit", "/quit"):
            break
        if not line.strip():
            continue
        messages.append({"role": "user", "content": line})
        text, ids = spec.encode_chat(messages)
        max_tokens = min(args.max_tokens, engine.core.max_model_len - len(ids))
        if max_tokens < 1:
            sys.stderr.write("cpuinfer: the conversation no longer fits --max-model-len; start a new chat\n")
            return 1
        params = sampling_params(args, spec.generation_defaults)
        params.max_tokens = max_tokens
        reply = stream_request(engine, str(turn), {"prompt": text, "prompt_token_ids": ids}, params)
        sys.stdout.write("\n")
        messages.append({"role": "assistant", "content": reply})
        turn += 1
    return 0
