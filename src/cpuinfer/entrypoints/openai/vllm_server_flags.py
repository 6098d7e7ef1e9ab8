"""`vllm serve`'s HTTP flags that cpuinfer takes with vLLM's meaning: TLS, a root path behind a proxy,
uvicorn's own log level, and request logging with prompts (--enable-log-requests)."""

from __future__ import annotations

import argparse
import os


def add_vllm_server_arguments(parser: argparse.ArgumentParser) -> None:
    """Add --ssl-*, --root-path, --uvicorn-log-level, --enable-log-requests and --max-log-len."""
    g = parser.add_argument_group("HTTP server (vLLM's flags)")
    g.add_argument("--ssl-keyfile", default=None, help="TLS private key file (PEM); serve HTTPS with --ssl-certfile")
    g.add_argument("--ssl-certfile", default=None, help="TLS certificate file (PEM)")
    g.add_argument("--ssl-ca-certs", default=None, help="CA certificates file to verify clients' certificates")
    g.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=0,
        help="whether client certificates are required (Python ssl's CERT_NONE 0 / OPTIONAL 1 / REQUIRED 2)",
    )
    g.add_argument(
        "--root-path",
        default=None,
        help="path prefix under which a proxy serves this app (FastAPI's root_path), e.g. /llm",
    )
    g.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="log level of uvicorn itself (default: --log-level)",
    )
    g.add_argument(
        "--enable-log-requests",
        action="store_true",
        help="log each request as it arrives, with its prompt, sampling parameters and prompt token ids (as vLLM)",
    )
    g.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="with --enable-log-requests: most characters / token ids of a prompt to log (default: all)",
    )


def check_vllm_server_arguments(args: argparse.Namespace) -> None:
    """Bad TLS settings are an error naming the flag before the server starts (uvicorn would fail later)."""
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise SystemExit("cpuinfer serve: HTTPS needs both --ssl-keyfile and --ssl-certfile")
    for flag in ("ssl_keyfile", "ssl_certfile", "ssl_ca_certs"):
        path = getattr(args, flag)
        if path and not os.path.isfile(path):
            raise SystemExit(f"cpuinfer serve: --{flag.replace('_', '-')} {path!r}: no such file")
    if args.root_path and not args.root_path.startswith("/"):
        raise SystemExit(f"cpuinfer serve: --root-path {args.root_path!r} must start with /")
    if args.max_log_len is not None and args.max_log_len < 0:
        raise SystemExit(f"cpuinfer serve: --max-log-len={args.max_log_len} must be >= 0")


def uvicorn_options(args: argparse.Namespace) -> dict:
    """The uvicorn.Config settings these flags map to."""
    opts: dict = {"root_path": args.root_path or ""}
    if args.ssl_keyfile:
        opts.update(
            ssl_keyfile=args.ssl_keyfile,
            ssl_certfile=args.ssl_certfile,
            ssl_ca_certs=args.ssl_ca_certs,
            ssl_cert_reqs=args.ssl_cert_reqs,
        )
    return opts
