"""What the engine holds for structured outputs: compile at admission (cached), a state per sequence, and each
step's batch mask, filled in one backend call and applied to the logits before sampling.

The fill can start before the model's forward pass (`start_masks`): the grammar states are final once the previous
step's tokens are accepted, and the backends fill on their own threads with the GIL released, so the mask is
usually ready when the logits are.

A server's engine core never compiles in its step loop: `compile_async` compiles a new constraint on a thread of
its own (llguidance releases the GIL while it compiles) and the request waits for it outside the scheduler, so a
62 KB regex (70-180 ms here) delays only itself. Building the backend does hold the GIL (llguidance's tokenizer
for SmolLM2's 49k vocabulary: 0.62-0.75 s with the GIL held, measured from another thread; 59 MB), so a server
builds it while the model loads (`warm_up`), not on its first constrained request with others running.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from cpuinfer.errors import InvalidRequestError
from cpuinfer.sampling_params import StructuredOutputsParams
from cpuinfer.structured.backend import GrammarBackend, GrammarState, make_backend
from cpuinfer.structured.bitmask import allocate_bitmask, apply_bitmask_

logger = logging.getLogger(__name__)


@dataclass
class MaskJob:
    """A batch's bitmask being filled in the background, for exactly these states (rows)."""

    states: list[GrammarState | None]
    rows: list[int]
    bitmask: torch.Tensor
    done: Future


class StructuredOutputManager:
    """Grammar compilation and masking for one model; the backend is built on first use (imported lazily)."""

    def __init__(
        self, backend_name: str, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], overlap: bool = True
    ):
        self.backend_name = backend_name
        self.overlap = overlap  # fill masks during the forward pass (start_masks); False: only in mask()
        self._pool: ThreadPoolExecutor | None = None  # mask fills
        self._compiler: ThreadPoolExecutor | None = None  # compile_async: never queued behind a mask fill
        self._warming: threading.Thread | None = None
        self._lock = threading.Lock()  # one backend build, whichever thread asks first
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._backend: GrammarBackend | None = None
        self._bitmask = allocate_bitmask(0, vocab_size)

    @property
    def backend(self) -> GrammarBackend:
        """The grammar backend (built by `warm_up`, or on the first structured request)."""
        if self._backend is None:
            with self._lock:
                if self._backend is None:
                    self._backend = self._build()
        return self._backend

    def _build(self) -> GrammarBackend:
        if self.tokenizer is None:
            raise InvalidRequestError(
                "structured outputs need the model's tokenizer, and this model has none", "structured_outputs"
            )
        try:
            return make_backend(self.backend_name, self.tokenizer, self.vocab_size, self.eos_token_ids)
        except ImportError as e:  # a broken install: say which package, refuse the request, keep serving
            raise InvalidRequestError(
                f"structured outputs need the {self.backend_name} package, which cannot "
                f"be imported here ({e}); pip install {self.backend_name}",
                "structured_outputs",
            ) from e

    def warm_up(self) -> None:
        """Start building the backend on a thread of its own (a server calls this before loading the model);
        `wait_warm` joins it. A backend that cannot be built is left to the first constrained request, which
        then gets the error."""
        if self._backend is not None or self._warming is not None or self.tokenizer is None:
            return

        def build() -> None:
            try:
                self.backend  # noqa: B018 - builds it
            except InvalidRequestError as e:  # no tokenizer, or the backend package missing
                logger.info("structured outputs are unavailable: %s", e)
            except Exception:  # the first constrained request retries the build and gets the error
                logger.warning("could not build the %s grammar backend", self.backend_name, exc_info=True)

        self._warming = threading.Thread(target=build, name="cpuinfer-grammar-warm-up", daemon=True)
        self._warming.start()

    def wait_warm(self) -> None:
        """Until `warm_up`'s build has ended (at once if none was started)."""
        if self._warming is not None:
            self._warming.join()

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar (cached by its text); raises InvalidRequestError if it does not compile."""
        return self.backend.compile(params)

    def cached(self, params: StructuredOutputsParams) -> Any | None:
        """The constraint's compiled grammar if this process has it already, else None (then `compile_async`)."""
        return None if self._backend is None else self._backend.cached(params)

    def compile_async(self, params: StructuredOutputsParams) -> Future:
        """`compile` on the compile thread; the future's exception is what `compile` would raise."""
        if self._compiler is None:
            self._compiler = ThreadPoolExecutor(1, thread_name_prefix="cpuinfer-grammar-compile")
        return self._compiler.submit(self.compile, params)

    def start_masks(self, states: list[GrammarState | None]) -> MaskJob | None:
        """Start filling the bitmask of these rows in the background (None when no row is constrained)."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows or not self.overlap:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="cpuinfer-grammar")
        bitmask = allocate_bitmask(len(rows), self.vocab_size)  # its own buffer: mask() may run meanwhile
        done = self._pool.submit(self.backend.fill_bitmask, [states[i] for i in rows], bitmask)
        return MaskJob(list(states), rows, bitmask, done)

    def mask(self, logits: torch.Tensor, states: list[GrammarState | None], job: MaskJob | None = None) -> None:
        """In place: mask row i of logits by states[i] (rows whose state is None are left alone); uses `job`'s
        bitmask when it was started for exactly these states."""
        rows = [i for i, s in enumerate(states) if s is not None]
        if not rows:
            return
        if (
            job is not None
            and len(job.states) == len(states)
            and all(a is b for a, b in zip(job.states, states, strict=True))
        ):
            job.done.result()
            with torch.inference_mode():
                apply_bitmask_(logits, job.bitmask, None if len(rows) == len(states) else rows)
            return
        if self._bitmask.shape[0] < len(rows):
            self._bitmask = allocate_bitmask(max(len(rows), 2 * self._bitmask.shape[0]), self.vocab_size)
        bitmask = self._bitmask[: len(rows)]
        self.backend.fill_bitmask([states[i] for i in rows], bitmask)
        with torch.inference_mode():  # the runner's logits are inference tensors
            apply_bitmask_(logits, bitmask, None if len(rows) == len(states) else rows)
