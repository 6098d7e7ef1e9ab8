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
    from cpuinfer.entrypoints.openai.cli_args import read_chat_template, resolve_model, served_names, tool_call_parser
    from cpuinfer.entrypoints.openai.engine_binding import make_engine_starter
    from cpuinfer.entrypoints.openai.guard import GuardConfig
    from cpuinfer.entrypoints.openai.request_bounds import RequestBounds
    from cpuinfer.entrypoints.openai.vllm_server_flags import check_vllm_server_arguments, uvicorn_options

    logging.basicConfig(
        level=getattr(logging, args.log_level.upper(), logging.INFO),
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
        datefmt="%m-%d %H:%M:%S",
    )
    resolve_model(args)
    names = served_names(args)  # as given (a hub id stays the served name, as in vLLM), before it is resolved
    check_vllm_server_arguments(args)
    fetch_model_files(args)  # a model id that cannot be found fails here, before uvicorn starts
    api_key = args.api_key if args.api_key is not None else envs.API_KEY.get()
    bad = [r for r in args.allow_unauthenticated_routes if not r.startswith("/")]
    if bad:
        raise SystemExit(f"cpuinfer serve: --allow-unauthenticated-routes takes paths such as /metrics; got {bad}")
    limit = args.limit_concurrency
    if limit is None:
        seqs = args.max_num_seqs or 128
        # Each data-parallel core behind this server queues as much as a single one does.
        cores = args.data_parallel_size if args.data_parallel_rank is None else 1
        limit = 2 * (seqs + args.max_waiting_requests) * max(1, cores) + 64
    config = ServerConfig(
        served_model_names=names,
        api_key=api_key,
        open_routes=tuple(args.allow_unauthenticated_routes),
        guard=GuardConfig(
            max_body_bytes=args.max_request_body_bytes,
            body_timeout=args.http_body_timeout,
            limit_concurrency=limit,
            bounds=RequestBounds.from_args(args),
        ),
        log_requests=not args.disable_log_requests,
        log_stats_interval=0.0 if args.disable_log_stats else args.log_stats_interval,
        tool_call_parser=tool_call_parser(args),
        chat_template=read_chat_template(args),
        log_prompts=args.enable_log_requests,
        max_log_len=args.max_log_len,
    )
    state = ServerState(config)
    log = logging.getLogger("cpuinfer.server")
    log.info(
        "cpuinfer serve: pid %d, http://%s:%d (model %s)",
        os.getpid(),
        args.host,
        args.port,
        config.served_model_names[0],
    )
    if not api_key and not _is_loopback(args.host):
        log.warning(
            "NO API KEY IS SET and the server listens on %s, beyond this machine: anyone who can reach "
            "port %d can use it. Set --api-key or CPUINFER_API_KEY / VLLM_API_KEY.",
            args.host,
            args.port,
        )
    return run_server(
        state,
        make_engine_starter(args),
        args.host,
        args.port,
        args.shutdown_timeout,
        log_level=args.uvicorn_log_level or args.log_level,
        http_header_timeout=args.http_header_timeout,
        max_idle_connections=args.max_idle_connections,
        **uvicorn_options(args),
    )


def fetch_model_files(args: argparse.Namespace) -> None:
    """MODEL and --tokenizer as local paths (a Hugging Face id resolved through the cache or the hub), and
    --generation-config checked: a bad one is one line and a non-zero exit, before the server starts."""
    from cpuinfer.model_loader.hub import resolve_model

    try:
        if args.model:
            args.model = resolve_model(args.model, args.revision, args.download_dir)
        if args.tokenizer:
            revision = args.tokenizer_revision or args.revision
            args.tokenizer = resolve_model(args.tokenizer, revision, args.download_dir, "--tokenizer")
    except ValueError as e:
        raise SystemExit(f"cpuinfer serve: {e}") from None
    gen = args.generation_config
    if gen not in ("auto", "vllm") and not os.path.isfile(os.path.join(gen, "generation_config.json")):
        raise SystemExit(
            f"cpuinfer serve: --generation-config {gen!r}: give auto, vllm or a directory holding "
            "generation_config.json"
        )


def _is_loopback(host: str) -> bool:
    """True for an address only this machine can reach."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: assume it is reachable
