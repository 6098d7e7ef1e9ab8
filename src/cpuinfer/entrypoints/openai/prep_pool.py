"""Request preparation off the HTTP process: a bounded pool of worker processes that render chat templates and
tokenize, each job under a timeout.

Jinja rendering and the tokenizer's Python-side work hold the GIL; done in the HTTP process, one request with a
slow template or a huge prompt delayed every other request and /health for seconds. A worker is a separate process,
so the HTTP loop never waits on it, and one that overruns --request-prep-timeout is killed and replaced (the request
gets a 400 naming the flag). A worker whose memory grew past MAX_GROWTH_BYTES over a request exits after answering
and is replaced, so what one large request made does not stay held. Workers come from a fork server (a fresh
process that imported this module), never from the HTTP process, which holds threads.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import multiprocessing as mp
import os
import pickle
from multiprocessing import forkserver
from typing import Any

import anyio

from cpuinfer.entrypoints.openai.errors import APIError

logger = logging.getLogger("cpuinfer.server")

MAX_GROWTH_BYTES = 256 * 1024 * 1024  # a worker that grew more than this since it started is replaced
START_TIMEOUT = 120.0  # seconds for a worker to import and load the tokenizer


class _WorkerLost(Exception):
    pass


class _WorkerTimeout(Exception):
    pass


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def release_heap() -> None:
    """Give freed heap back to the OS (glibc keeps it otherwise)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _worker_main(conn, spec_bytes: bytes, cpus: set[int]) -> None:
    """A worker: answer (method, args) with ("ok", result, recycle) or (kind, message, param, recycle). It runs on
    `cpus`, the HTTP process's own when the worker started (off the inference cores once the front end is pinned):
    the fork server it comes from started before that pinning."""
    with contextlib.suppress(OSError):
        os.sched_setaffinity(0, cpus)
    from cpuinfer.entrypoints.openai.tokenization import Tokenization
    from cpuinfer.errors import InvalidRequestError
    from cpuinfer.model_loader.chat_template import TemplateOutputTooLarge

    tok = Tokenization(pickle.loads(spec_bytes))
    conn.send(("ready", tok.max_token_chars))
    base = _rss()
    while True:
        try:
            method, args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            reply: tuple = ("ok", getattr(tok, method)(*args))
        except InvalidRequestError as e:
            reply = ("invalid", e.message, e.param)
        except TemplateOutputTooLarge as e:
            reply = ("invalid", f"The chat template's output is too large: {e}.", "messages")
        except MemoryError:
            reply = ("invalid", "Preparing this request ran out of memory; send less.", "messages")
        except Exception as e:  # noqa: BLE001 - a template error is about the conversation the client sent
            reply = ("template", f"{type(e).__name__}: {str(e)[:500]}", "messages")
        recycle = _rss() - base > MAX_GROWTH_BYTES
        conn.send((*reply, recycle))
        if recycle:
            return
        release_heap()


class _Worker:
    """One worker process and its end of the pipe."""

    def __init__(self, ctx, spec_bytes: bytes):
        self.conn, child = ctx.Pipe()
        cpus = os.sched_getaffinity(0)
        self.proc = ctx.Process(target=_worker_main, args=(child, spec_bytes, cpus), daemon=True, name="cpuinfer-prep")
        self.proc.start()
        child.close()
        if not self.conn.poll(START_TIMEOUT):
            self.kill()
            raise RuntimeError(f"a request-preparation worker did not start within {START_TIMEOUT:g} s")

    def call(self, method: str, args: tuple, timeout: float) -> tuple:
        """Send a job and wait for its reply (in a thread: the HTTP loop does not wait); _WorkerLost when the
        worker died or overran `timeout` (then it is killed)."""
        try:
            self.conn.send((method, args))
            if not self.conn.poll(timeout):
                self.kill()
                raise _WorkerTimeout
            return self.conn.recv()
        except (EOFError, OSError, BrokenPipeError) as e:
            self.kill()
            raise _WorkerLost from e

    def kill(self) -> None:
        """Stop the process now."""
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.join(5)
        self.conn.close()


def start_fork_server() -> Any:
    """The forkserver context the workers come from, its server started now (it returns at once; the server
    imports in the background). A fresh single-threaded process imports this module (torch included, ~145 MB)
    once and forks each worker from it, so the workers share those pages (the HTTP process itself, which holds
    threads, is never forked). A worker then holds ~50 MB of its own (the tokenizer) instead of ~200 MB when
    spawned. The import takes ~3.5 s of the pool's ~4 s start here, so a server calls this before it loads
    the model: the pool then starts in ~0.5 s once the engine is up."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])
    forkserver.ensure_running()
    return ctx


class PrepPool:
    """`workers` processes doing Tokenization's encode / encode_chat for the HTTP process."""

    def __init__(self, spec: Any, workers: int, timeout: float):
        self.size = workers
        self.timeout = timeout
        self._spec_bytes = pickle.dumps(spec)
        self._ctx = start_fork_server()
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        self._all: set[_Worker] = set()
        self._closed = False
        self._respawning = 0  # workers being started in place of lost ones

    async def start(self) -> None:
        """Start every worker (in threads: each imports the package and loads the tokenizer)."""
        workers = await asyncio.gather(*(asyncio.to_thread(self._new_worker) for _ in range(self.size)))
        for w in workers:
            self._idle.put_nowait(w)

    def _new_worker(self) -> _Worker:
        w = _Worker(self._ctx, self._spec_bytes)
        w.conn.recv()  # ("ready", ...)
        self._all.add(w)
        return w

    def _replace(self, w: _Worker) -> None:
        self._all.discard(w)
        if self._closed:
            return

        async def respawn():
            try:
                fresh = await asyncio.to_thread(self._new_worker)
            except (RuntimeError, OSError):
                logger.exception("could not restart a request-preparation worker")
                return
            finally:
                self._respawning -= 1
            self._idle.put_nowait(fresh)

        self._respawning += 1  # counted now: a request arriving before the task runs waits for this worker
        asyncio.ensure_future(respawn())  # noqa: RUF006 - it puts itself back in the queue; nothing awaits it

    async def run(self, method: str, *args: Any) -> Any:
        """Tokenization.<method>(*args) in a worker; APIError 400 for the request's own fault (a limit, a template
        error, the timeout), 503 when every worker stayed busy for the whole timeout."""
        if not self._all and not self._respawning:
            raise APIError("No request-preparation worker is running (see the server log); retry shortly.", 503)
        try:
            w = await asyncio.wait_for(self._idle.get(), self.timeout)
        except (TimeoutError, asyncio.TimeoutError):
            raise APIError(
                f"All {self.size} request-preparation workers stayed busy for {self.timeout:g} s "
                "(--request-prep-workers, --request-prep-timeout); retry shortly.",
                503,
                headers={"Retry-After": "1"},
            ) from None
        reply = None
        lost = False
        try:
            reply = await anyio.to_thread.run_sync(w.call, method, args, self.timeout)
        except _WorkerTimeout:
            lost = True
            raise APIError(
                f"Preparing this request (chat template and tokenization) took longer than {self.timeout:g} s "
                "(--request-prep-timeout); send a smaller request or a simpler template.",
                400,
                "messages" if method == "encode_chat" else "prompt",
            ) from None
        except _WorkerLost:
            lost = True
            raise APIError(
                "Preparing this request stopped its worker process (out of memory?); send a smaller request.",
                400,
                "messages" if method == "encode_chat" else "prompt",
            ) from None
        finally:
            if lost:
                self._replace(w)
            elif reply is not None and reply[-1]:  # it exits by itself after a large request
                await asyncio.to_thread(w.proc.join, 5)
                self._replace(w)
            elif not w.proc.is_alive():  # cancelled while its job overran and it was killed
                w.kill()
                self._replace(w)
            else:
                self._idle.put_nowait(w)
        kind = reply[0]
        if kind == "ok":
            return reply[1]
        message, param = reply[1], reply[2]
        if kind == "template":
            message = f"The chat template cannot format these messages: {message}"
        raise APIError(message, 400, param)

    def close(self) -> None:
        """Stop every worker."""
        self._closed = True
        for w in list(self._all):
            w.kill()
        self._all.clear()
