"""Shared pieces of the generate / chat / bench commands: engine creation and sampling flags."""

from __future__ import annotations

import argparse
import sys

from cpuinfer.config import EngineArgs
from cpuinfer.sampling_params import SamplingParams


def add_sampling_arguments(parser: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    """--max-tokens, --temperature, --top-p, --top-k, --min-p, --repetition-penalty."""
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="Most tokens to generate.")
    g.add_argument("--temperature", type=float, default=None, help="0 = greedy (default: the model's, else 1).")
    g.add_argument("--top-p", type=float, default=None)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--min-p", type=float, default=None)
    g.add_argument("--repetition-penalty", type=float, default=None)


def sampling_params(args: argparse.Namespace, defaults: dict, **extra) -> SamplingParams:
    """SamplingParams from the flags, falling back to the model's generation defaults."""
    kw = {k: v for k, v in defaults.items() if k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")}
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
        v = getattr(args, name, None)
        if v is not None:
            kw[name] = v
    return SamplingParams(max_tokens=args.max_tokens, **kw, **extra)


def make_engine(args: argparse.Namespace):
    """An in-process LLMEngine from the engine flags (exits with one clear line on bad input)."""
    from cpuinfer.engine.llm_engine import LLMEngine

    try:
        return LLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
    except ValueError as exc:
        sys.stderr.write(f"cpuinfer: {exc}\n")
        raise SystemExit(2) from None


def stream_request(engine, request_id: str, prompt, params: SamplingParams, out=sys.stdout) -> str:
    """Run one request to completion, writing its text to `out` as it is produced; returns the full text."""
    from cpuinfer.sampling_params import RequestOutputKind

    params.output_kind = RequestOutputKind.DELTA
    engine.add_request(request_id, prompt, params)
    text = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            piece = o.outputs[0].text
            if piece:
                out.write(piece)
                out.flush()
                text.append(piece)
    return "".join(text)
