"""Command-line flags of `cpuinfer serve`: the engine's flags (shared with the other commands)
plus the HTTP front end's, spelled as vLLM spells them."""

from __future__ import annotations

import argparse
import os

from cpuinfer.entrypoints.openai.request_bounds import add_bounds_arguments
from cpuinfer.entrypoints.openai.tool_parsers import TOOL_PARSERS
from cpuinfer.entrypoints.openai.vllm_server_flags import add_vllm_server_arguments


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add every `serve` flag to `parser`."""
    from cpuinfer.entrypoints.openai.engine_binding import add_engine_arguments

    parser.add_argument(
        "model_tag",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="HF model directory, .gguf file or Hugging Face model id (default: the bundled SmolLM2-135M-Instruct); "
        "same as --model",
    )
    add_engine_arguments(parser)
    g = parser.add_argument_group("HTTP server")
    g.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port to listen on (default 8000)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every route but /health and /ping "
        "(default: $CPUINFER_API_KEY/$VLLM_API_KEY)",
    )
    g.add_argument(
        "--allow-unauthenticated-routes",
        nargs="+",
        default=[],
        metavar="PATH",
        help="routes that need no API key even with --api-key, e.g. /metrics /docs /openapi.json "
        "(deny by default; vLLM leaves /tokenize, /detokenize, /metrics and /docs open)",
    )
    g.add_argument(
        "--limit-concurrency",
        type=_positive_int,
        default=None,
        help="requests in flight past which the server answers 503 with Retry-After at once (/health and /ping "
        "are never refused; default: 2 x (--max-num-seqs + --max-waiting-requests) + 64)",
    )
    g.add_argument(
        "--max-idle-connections",
        type=_positive_int,
        default=1024,
        help="open connections without a request in progress; past this the longest-idle one is closed",
    )
    g.add_argument(
        "--http-header-timeout",
        type=_positive_float,
        default=10.0,
        help="seconds a connection has to send a request's headers before it is closed (nginx: 60)",
    )
    g.add_argument(
        "--http-body-timeout",
        type=_positive_float,
        default=30.0,
        help="seconds a request has to send its whole body; then 408",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        help="model name(s) the API answers to (default: the model argument)",
    )
    g.add_argument(
        "--max-request-body-bytes",
        type=_positive_int,
        default=8 * 1024 * 1024,
        help="larger request bodies get 413 (default 8 MiB)",
    )
    g.add_argument(
        "--shutdown-timeout",
        type=float,
        default=10.0,
        help="seconds in-flight requests may run after SIGINT/SIGTERM before they are aborted",
    )
    g.add_argument("--disable-log-requests", action="store_true", help="no per-request log line")
    g.add_argument("--disable-log-stats", action="store_true", help="no periodic throughput log line")
    g.add_argument("--log-stats-interval", type=float, default=10.0, help="seconds between throughput lines")
    g.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model decide when to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    g.add_argument(
        "--tool-call-parser",
        default=None,
        choices=sorted(TOOL_PARSERS),
        help="how tool calls are found in the model's replies: hermes (<tool_call>{json}</tool_call>: "
        "Qwen 2.5/3, Hermes, SmolLM3) or llama3_json (Llama 3.x)",
    )
    g.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template (file path or the template itself) used instead of the model's",
    )
    add_bounds_arguments(parser, _positive_int)
    g.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="log level of the server and uvicorn",
    )
    add_vllm_server_arguments(parser)


def resolve_model(args: argparse.Namespace) -> None:
    """`serve MODEL` and `serve --model MODEL` mean the same (as in vLLM); giving two different ones is an error."""
    tag = getattr(args, "model_tag", None)
    if tag and getattr(args, "model", None) and args.model != tag:
        raise SystemExit(f"cpuinfer serve: got MODEL {tag!r} and --model {args.model!r}; give only one")
    if tag:
        args.model = tag


def served_names(args: argparse.Namespace) -> list[str]:
    """The names the API answers to: --served-model-name, else the model argument as given."""
    if args.served_model_name:
        return list(args.served_model_name)
    if args.model:
        return [args.model]
    return ["SmolLM2-135M-Instruct"]


def tool_call_parser(args: argparse.Namespace) -> str | None:
    """The parser for tool_choice "auto", or None when auto tool choice is off (as vLLM: both flags, or neither)."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit(
            f"cpuinfer serve: --enable-auto-tool-choice needs --tool-call-parser ({', '.join(sorted(TOOL_PARSERS))})"
        )
    return args.tool_call_parser if args.enable_auto_tool_choice else None


def read_chat_template(args: argparse.Namespace) -> str | None:
    """--chat-template: a file's text, or the argument itself when it is a template.

    As vLLM: a value with no template syntax (no braces, no newline) is a path, and one that does not exist is
    an error (it used to become the template: every chat rendered to the path's text)."""
    value = args.chat_template
    if value and os.path.isfile(value):
        with open(value, encoding="utf-8") as f:
            return f.read()
    if value and not any(c in value for c in "{}\n"):
        raise SystemExit(
            f"cpuinfer serve: --chat-template {value!r}: no such file (a template given inline must contain "
            "Jinja syntax such as {{ messages }})"
        )
    return value


def _positive_int(value: str) -> int:
    x = int(value)
    if x < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return x


def _positive_float(value: str) -> float:
    x = float(value)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return x
