"""The FastAPI app of `cpuinfer serve` and the uvicorn loop around it.

HTTP parsing, validation and tokenization run here, in the front-end
process; the engine core runs in its own process behind the engine client.
The app starts answering at once: /health says 503 ("loading") until the
engine has loaded the model, then 200 ("healthy").

If the engine itself fails (its process exits, crashes, or stops answering
heartbeats), in-flight requests fail at once and the server exits with code
1, as vLLM's does, so that an orchestrator restarts it instead of a server
answering 503 forever. A single request's failure never gets this far: the
engine fails that request alone.

With --api-key every route needs the key except the probes (/health, /ping)
and what --allow-unauthenticated-routes lists.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import secrets
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Annotated

import uvicorn
from fastapi import Body, FastAPI, Request
from fastapi.responses import JSONResponse, Response

from cpuinfer.engine.messages import EngineStats
from cpuinfer.entrypoints.openai.client_errors import LogClientErrors
from cpuinfer.entrypoints.openai.connections import guarded_protocol
from cpuinfer.entrypoints.openai.embeddings_protocol import EmbeddingRequest, EmbeddingResponse
from cpuinfer.entrypoints.openai.engine_adapter import EngineAdapter
from cpuinfer.entrypoints.openai.errors import APIError, error_body, error_response, install_error_handlers
from cpuinfer.entrypoints.openai.guard import PROBE_ROUTES, GuardConfig, RequestGuard, route_path
from cpuinfer.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from cpuinfer.entrypoints.openai.prep_pool import PrepPool, start_fork_server
from cpuinfer.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ErrorResponse,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    dump,
)
from cpuinfer.entrypoints.openai.responses_protocol import ResponsesRequest
from cpuinfer.entrypoints.openai.scoring_protocol import (
    ClassificationRequest,
    ClassificationResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from cpuinfer.entrypoints.openai.serving import OpenAIServing
from cpuinfer.errors import EngineDeadError

logger = logging.getLogger("cpuinfer.server")

ERRORS = {code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 500, 503)}
GRACE_MARGIN = 2.0  # seconds between ending running requests at shutdown and uvicorn cancelling them
ENGINE_DEATH_EXIT_DELAY = 1.0  # seconds for the failed requests' error responses to reach their clients


@dataclass
class ServerConfig:
    """Front-end settings (the engine's own settings live in the engine's args)."""

    served_model_names: list[str]
    api_key: str = ""
    open_routes: tuple[str, ...] = ()  # paths that need no API key besides the probes (--allow-unauthenticated-routes)
    log_requests: bool = True
    log_stats_interval: float = 10.0  # seconds; 0 disables the periodic stats line
    tool_call_parser: str | None = None  # set by --enable-auto-tool-choice --tool-call-parser: tool_choice "auto"
    chat_template: str | None = None  # --chat-template: replaces the model's
    guard: GuardConfig = field(default_factory=GuardConfig)  # in-flight limit, body limits, request bounds
    log_prompts: bool = False  # --enable-log-requests: each request's prompt and parameters as it arrives
    max_log_len: int | None = None  # --max-log-len: most characters / ids of a logged prompt


@dataclass
class ServerState:
    """What the routes need; `serving` is None until the engine is up."""

    config: ServerConfig
    engine: EngineAdapter | None = None
    serving: OpenAIServing | None = None
    metrics: ServerMetrics | None = None
    load_error: str | None = None
    engine_failure: str | None = None  # set when the engine died: the server exits with code 1
    last_stats: EngineStats = field(default_factory=EngineStats)
    background: list[asyncio.Task] = field(default_factory=list)
    prep: PrepPool | None = None  # request-preparation workers, started with the engine
    draining: asyncio.Event | None = None  # set once the shutdown grace period is over (made on the server's loop)

    def require_serving(self) -> OpenAIServing:
        """The serving object, or a 503 while loading / after a failure."""
        if self.serving is None:
            why = f"failed to load: {self.load_error}" if self.load_error else "the model is still loading"
            raise APIError(f"Server not ready ({why}); retry shortly.", 503)
        return self.serving


class APIKeyAuth:
    """ASGI middleware: 401 without the API key (every route but the probes and the configured open routes: deny
    by default). Pure ASGI (not BaseHTTPMiddleware) so streaming responses pass straight through."""

    def __init__(self, app, config: ServerConfig):
        self.app = app
        self.config = config
        self.expected = f"Bearer {config.api_key}".encode() if config.api_key else None
        self.open = set(PROBE_ROUTES) | set(config.open_routes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or self.expected is None:
            return await self.app(scope, receive, send)
        if route_path(scope) not in self.open and scope["method"] != "OPTIONS":
            got = dict(scope.get("headers") or []).get(b"authorization", b"")
            if not secrets.compare_digest(got, self.expected):
                what = "missing" if not got else "invalid"
                msg = (
                    f"Unauthorized: {what} API key; send the header 'Authorization: Bearer <key>' with the "
                    "key the server was started with (--api-key / VLLM_API_KEY)."
                )
                return await error_response(msg, 401)(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(state: ServerState, start_engine: Callable[[], Awaitable[EngineAdapter]] | None = None) -> FastAPI:
    """The app; `start_engine` runs in the background after startup and returns the ready engine."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        if start_engine is not None:
            state.background.append(asyncio.create_task(_load(state, start_engine)))
        try:
            yield
        finally:
            for task in state.background:
                task.cancel()
            if state.prep is not None:
                state.prep.close()
            if state.engine is not None:
                await state.engine.shutdown()

    app = FastAPI(title="cpuinfer OpenAI-compatible server", version=_version(), lifespan=lifespan)
    app.state.server = state
    install_error_handlers(app)
    # The last added runs first: the key is checked before the guard reads any body, and every 4xx (the key's,
    # the guard's, the routes') is logged with its request id.
    app.add_middleware(RequestGuard, config=state.config.guard, char_limits=lambda: _char_limits(state))
    app.add_middleware(APIKeyAuth, config=state.config)
    app.add_middleware(LogClientErrors)

    @app.get("/health", responses={503: {"model": ErrorResponse}})
    async def health() -> Response:
        """200 {"status": "healthy"} when the engine serves requests; 503 with status "loading", "dead",
        "degraded" (a data-parallel engine core died; the others still serve) or "shutting down" otherwise
        (details are in the server log, not here)."""
        status, why = health_status(state)
        if status == "healthy":
            return JSONResponse({"status": status})
        return JSONResponse({"status": status, **error_body(why, 503)}, status_code=503)

    @app.get("/ping", include_in_schema=False)
    async def ping() -> Response:
        """Alias of /health (SageMaker-style probes)."""
        return await health()

    @app.get("/version")
    async def version() -> dict:
        """The cpuinfer version."""
        return {"version": _version()}

    @app.get("/metrics", response_class=Response)
    async def metrics() -> Response:
        """Prometheus exposition of the server and engine metrics."""
        if state.engine is not None and state.engine.healthy:
            # shield: a timed-out scrape must not cancel the engine's pending stats reply (it answers between steps).
            with contextlib.suppress(TimeoutError, asyncio.TimeoutError, EngineDeadError):
                state.last_stats = await asyncio.wait_for(asyncio.shield(state.engine.stats()), 5.0)
        if state.metrics is None:
            return Response(b"", media_type=CONTENT_TYPE)
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses=ERRORS)
    async def list_models() -> JSONResponse:
        """The served model(s)."""
        return JSONResponse(dump(state.require_serving().models()))

    @app.post("/v1/completions", response_model=CompletionResponse, responses=ERRORS)
    async def completions(req: CompletionRequest, raw: Request):
        """OpenAI completions; `stream: true` answers with server-sent events."""
        return await state.require_serving().completions(req, raw)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=ERRORS)
    async def chat_completions(req: ChatCompletionRequest, raw: Request):
        """OpenAI chat completions with the model's chat template; `stream: true` answers with SSE."""
        return await state.require_serving().chat(req, raw)

    @app.post("/v1/responses", responses=ERRORS)
    async def create_response(req: ResponsesRequest, raw: Request):
        """OpenAI Responses API (text, function calls, structured output); `stream: true` answers with SSE events."""
        return await state.require_serving().responses(req, raw)

    def pooled(body) -> JSONResponse:
        """A pooling route's answer, or 499 when its client left before it was done."""
        if body is None:
            return JSONResponse({}, status_code=499)  # the client left (nginx's code); nobody reads this
        return JSONResponse(dump(body))

    @app.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERRORS)
    async def embeddings(req: EmbeddingRequest, raw: Request):
        """OpenAI embeddings of a pooling model (--runner pooling): one vector per input."""
        return pooled(await state.require_serving().embeddings(req, raw))

    @app.post("/score", response_model=ScoreResponse, responses=ERRORS)
    @app.post("/v1/score", response_model=ScoreResponse, responses=ERRORS)
    async def score(req: ScoreRequest, raw: Request):
        """vLLM's scores of text pairs: a cross-encoder's, or an embedding model's cosine similarity."""
        return pooled(await state.require_serving().score(req, raw))

    @app.post("/rerank", response_model=RerankResponse, responses=ERRORS)
    @app.post("/v1/rerank", response_model=RerankResponse, responses=ERRORS)
    @app.post("/v2/rerank", response_model=RerankResponse, responses=ERRORS)
    async def rerank(req: RerankRequest, raw: Request):
        """Jina's / Cohere's rerank: documents by relevance to a query, highest first."""
        return pooled(await state.require_serving().rerank(req, raw))

    @app.post("/classify", response_model=ClassificationResponse, responses=ERRORS)
    @app.post("/v1/classify", response_model=ClassificationResponse, responses=ERRORS)
    async def classify(req: ClassificationRequest, raw: Request):
        """A sequence classifier's label scores of each input."""
        return pooled(await state.require_serving().classify(req, raw))

    @app.post("/tokenize", response_model=TokenizeResponse, responses=ERRORS)
    async def tokenize(req: Annotated[TokenizeCompletionRequest | TokenizeChatRequest, Body()]):
        """Token ids of a prompt or of chat messages after the chat template."""
        return JSONResponse(dump(await state.require_serving().tokenize(req)))

    @app.post("/detokenize", response_model=DetokenizeResponse, responses=ERRORS)
    async def detokenize(req: DetokenizeRequest):
        """Text of token ids."""
        return JSONResponse(dump(await state.require_serving().detokenize(req)))

    return app


def _char_limits(state: ServerState) -> tuple[int | None, int | None]:
    """The most prompt characters that could fit (per prompt, per request); unknown while loading."""
    return state.serving.char_limits() if state.serving is not None else (None, None)


def health_status(state: ServerState) -> tuple[str, str]:
    """(status word, client-safe explanation) of the server."""
    if state.engine_failure is not None or (state.engine is not None and state.engine.dead):
        return "dead", "the engine has failed; the server is exiting (details in the server log)"
    if state.serving is None or state.engine is None:
        if state.load_error:
            return "dead", "the engine failed to load the model (details in the server log)"
        return "loading", "not ready: loading the model"
    if not state.engine.healthy:
        return "shutting down", "the server is shutting down"
    degraded = state.engine.degraded()
    if degraded:
        return "degraded", degraded
    return "healthy", ""


async def _watch_engine(state: ServerState, interval: float = 0.25) -> None:
    """Exit the server (code 1) once the engine has died, after its failed requests were answered; log when
    part of it (a data-parallel core) dies."""
    reported = None
    while True:
        await asyncio.sleep(interval)
        engine = state.engine
        degraded = engine.degraded() if engine is not None else None
        if degraded != reported and degraded is not None:
            logger.error("%s; in-flight requests of the dead core(s) failed; /health answers 503", engine.status_text())
        reported = degraded
        if engine is not None and engine.dead:
            state.engine_failure = engine.status_text()
            logger.error(
                "the engine failed (%s): in-flight requests failed; exiting with code 1 so the server can be restarted",
                state.engine_failure,
            )
            await asyncio.sleep(ENGINE_DEATH_EXIT_DELAY)
            signal.raise_signal(signal.SIGTERM)
            return


async def _load(state: ServerState, start_engine: Callable[[], Awaitable[EngineAdapter]]) -> None:
    """Start the engine, then open the API and the stats logger."""
    t0 = time.monotonic()
    try:
        start_fork_server()  # its imports run while the engine loads (the prep pool's start waits for them)
        engine = await start_engine()
    except Exception as e:  # the server keeps answering /health with the reason
        state.load_error = f"{type(e).__name__}: {e}"
        if isinstance(e, ValueError):  # bad flags / variables / model path: the message says what to fix
            logger.error("engine failed to start: %s", e)
        else:
            logger.exception("engine failed to start")
        signal.raise_signal(signal.SIGTERM)  # a server without a model is no use: shut down (exit code 1)
        return
    bounds = state.config.guard.bounds
    prep = PrepPool(engine.tokenization.spec, bounds.prep_workers, bounds.prep_timeout)
    try:
        await prep.start()
        await asyncio.to_thread(lambda: engine.tokenization.max_token_chars)  # computed once, off the loop
    except (RuntimeError, OSError) as e:
        prep.close()
        state.load_error = f"request-preparation workers failed to start: {e}"
        logger.error("%s", state.load_error)
        signal.raise_signal(signal.SIGTERM)
        return
    state.prep = prep
    state.engine = engine
    names = state.config.served_model_names
    state.metrics = ServerMetrics(names[0], lambda: state.last_stats, engine.core_states)
    state.serving = OpenAIServing(
        engine,
        names,
        state.metrics,
        state.config.log_requests,
        state.config.tool_call_parser,
        state.config.chat_template,
        prep,
        state.draining,
        bounds.window_sequences,
        log_prompts=state.config.log_prompts,
        max_log_len=state.config.max_log_len,
    )
    state.background.append(asyncio.create_task(_watch_engine(state)))
    logger.info(
        "engine ready in %.1fs: serving %s (max_model_len=%d)",
        time.monotonic() - t0,
        ", ".join(names),
        engine.max_model_len,
    )
    if state.config.log_stats_interval > 0:
        state.background.append(asyncio.create_task(_log_stats(state, state.config.log_stats_interval)))


async def _log_stats(state: ServerState, interval: float) -> None:
    """Every `interval` seconds, a vLLM-style throughput line (skipped while idle)."""
    m = state.metrics
    last_prompt = last_gen = 0.0
    last_t = time.monotonic()
    while True:
        await asyncio.sleep(interval)
        engine = state.engine
        if engine is None or not engine.healthy:
            continue
        try:
            s = await asyncio.wait_for(asyncio.shield(engine.stats()), 5.0)
        except (TimeoutError, asyncio.TimeoutError, EngineDeadError):
            continue
        state.last_stats = s
        now = time.monotonic()
        prompt, gen = m.prompt_tokens._value.get(), m.generation_tokens._value.get()
        dt = max(now - last_t, 1e-9)
        if prompt != last_prompt or gen != last_gen or s.num_running or s.num_waiting:
            tier = ""
            if s.kv_offload_capacity_bytes:  # the host prefix tier, as vLLM logs its external prefix cache
                rate = s.external_prefix_cache_hits / max(s.external_prefix_cache_queries, 1)
                held = s.kv_offload_bytes / 2**30
                tier = f", External prefix cache hit rate: {100 * rate:.1f}%, Host tier: {held:.2f} GiB"
            logger.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%, "
                "Preemptions: %d%s",
                (prompt - last_prompt) / dt,
                (gen - last_gen) / dt,
                s.num_running,
                s.num_waiting,
                100 * s.kv_cache_usage,
                100 * s.prefix_cache_hit_rate,
                s.num_preemptions,
                tier,
            )
        last_prompt, last_gen, last_t = prompt, gen, now


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("cpuinfer")
    except PackageNotFoundError:
        return "0.0.0"


class _Server(uvicorn.Server):
    """uvicorn, except that a SIGINT/SIGTERM after a clean shutdown exits 0 instead of re-raising, and that running
    requests are ended with an error (streams: an error event and [DONE]) when the grace period is over, before
    uvicorn cancels them (GRACE_MARGIN later)."""

    drain_after: float = 10.0
    draining: asyncio.Event | None = None

    async def shutdown(self, sockets=None) -> None:
        """Stop accepting; after `drain_after` seconds end what still runs; then uvicorn's shutdown."""
        if self.draining is not None:
            asyncio.get_running_loop().call_later(self.drain_after, self.draining.set)
        await super().shutdown(sockets)

    @contextlib.contextmanager
    def capture_signals(self):
        handled = (signal.SIGINT, signal.SIGTERM)
        original = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)


def run_server(
    state: ServerState,
    start_engine: Callable[[], Awaitable[EngineAdapter]],
    host: str,
    port: int,
    shutdown_timeout: float,
    log_level: str = "info",
    sock=None,
    http_header_timeout: float = 10.0,
    max_idle_connections: int = 1024,
    **uvicorn_options,
) -> int:
    """Serve until SIGINT/SIGTERM; in-flight requests get `shutdown_timeout` seconds to finish, then are aborted.

    Returns the exit code: 1 if the engine failed to load or died while serving, else 0.
    The in-flight request limit is the guard's (ServerConfig.guard); connections are bounded by
    `http_header_timeout` and `max_idle_connections` (connections.py).
    `uvicorn_options`: more uvicorn.Config settings (TLS files, root_path: vllm_server_flags.uvicorn_options).
    """
    app = build_app(state, start_engine)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=False,
        timeout_graceful_shutdown=math.ceil(shutdown_timeout + GRACE_MARGIN),
        lifespan="on",
        timeout_keep_alive=5,
        http=guarded_protocol(http_header_timeout, max_idle_connections),
        **uvicorn_options,
    )
    server = _Server(config)
    server.drain_after = shutdown_timeout

    async def serve():
        state.draining = server.draining = asyncio.Event()
        await server.serve(sockets=[sock] if sock is not None else None)

    asyncio.run(serve())
    return 1 if (state.load_error or state.engine_failure) else 0
