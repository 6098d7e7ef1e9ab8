"""`cpuinfer serve [MODEL]`: the OpenAI-compatible HTTP server (a drop-in for `vllm serve`)."""

from __future__ import annotations

import argparse
import logging
import os


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `cpuinfer serve`: the engine's (as in vLLM) plus the HTTP front end's."""
    from cpuinfer.entrypoints.openai.cli_args import add_server_arguments

    add_server_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Start the engine process and serve HTTP until SIGINT/SIGTERM."""
    from cpuinfer import envs
    from cpuinfer.entrypoints.openai.api_server import ServerConfig, ServerState, run_server
    from cpuinfer.entrypoints.openai.cli_args import resolve_model, served_names
    from cpuinfer.entrypoints.openai.engine_binding import make_engine_starter

    logging.basicConfig(level=getattr(logging, args.log_level.upper(), logging.INFO),
                        format="%(levelname)s %(asctime)s %(name)s: %(message)s", datefmt="%m-%d %H:%M:%S")
    resolve_model(args)
    api_key = args.api_key if args.api_key is not None else envs.API_KEY.get()
    config = ServerConfig(served_model_names=served_names(args), api_key=api_key,
                          max_body_bytes=args.max_request_body_bytes, log_requests=not args.disable_log_requests,
                          log_stats_interval=0.0 if args.disable_log_stats else args.log_stats_interval)
    state = ServerState(config)
    logging.getLogger("cpuinfer.server").info("cpuinfer serve: pid %d, http://%s:%d (model %s)", os.getpid(),
                                              args.host, args.port, config.served_model_names[0])
    return run_server(state, make_engine_starter(args), args.host, args.port, args.shutdown_timeout,
                      log_level=args.log_level)
