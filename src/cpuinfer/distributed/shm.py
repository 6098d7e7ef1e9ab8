"""The tensor-parallel ranks' collectives, through shared memory (the kernel library's `ShmComm`).

Each rank is a process; all of them construct a `ShmCommunicator` with the same name and world size (rank 0
creates the segment, the others attach), then make the same collective calls in the same order. All-reduce
sums in float32 in rank order and rounds once, so every rank ends with the same bits. A peer that exits or
does not arrive within `timeout_s` raises RuntimeError naming it, and the communicator is unusable after.
"""

from __future__ import annotations

import os
import secrets

import torch

from .. import _C

DEFAULT_BUFFER_BYTES = 16 << 20
DEFAULT_TIMEOUT_S = 30.0


def unique_name() -> str:
    """A fresh shared-memory segment name (short enough for macOS's 31-character limit)."""
    return f"cpuinfer-{os.getpid()}-{secrets.token_hex(4)}"


class ShmCommunicator:
    """One rank's end of the shared-memory communicator; blocks in the constructor until every rank attached."""

    def __init__(
        self,
        name: str,
        rank: int,
        world_size: int,
        buffer_bytes: int = DEFAULT_BUFFER_BYTES,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        watch: tuple[int, ...] = (),
        labels: tuple[str, ...] = (),
    ):
        # watch: pids (workers just spawned, a launcher) whose exit ends the wait for the ranks at once.
        # labels: each member's name in errors (default "tensor-parallel rank r").
        self._comm = _C.ShmComm(name, rank, world_size, buffer_bytes, timeout_s, list(watch), list(labels))
        self.rank = rank
        self.world_size = world_size

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum t over the ranks, in place (contiguous float32, bfloat16 or float16); returns t."""
        self._comm.all_reduce_(t)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's t concatenated along dim in rank order (e.g. logits [T, V/N] -> [T, V])."""
        t = t.contiguous()
        out = torch.empty((self.world_size, *t.shape), dtype=t.dtype)
        if t.numel():  # every rank has the same shape: all skip an empty gather together
            self._comm.all_gather(t, out)
        if t.dim() == 0:
            return out
        dim = dim % t.dim()
        if dim == 0:
            return out.view(-1, *t.shape[1:])
        shape = (*t.shape[:dim], self.world_size * t.shape[dim], *t.shape[dim + 1 :])
        return out.movedim(0, dim).reshape(shape)

    def broadcast_(self, t: torch.Tensor, root: int = 0) -> torch.Tensor:
        """Every rank's t = root's t, in place (contiguous, any dtype); returns t."""
        self._comm.broadcast_(t, root)
        return t

    def barrier(self) -> None:
        """Return once every rank has called barrier()."""
        self._comm.barrier()

    def close(self) -> None:
        """Detach (idempotent); peers still waiting on this rank fail at once."""
        self._comm.close()

    @property
    def native(self):
        """The `_C.ShmComm` behind this communicator, for kernels that take it (keep this object alive while
        they hold it)."""
        return self._comm

    @property
    def closed(self) -> bool:
        """Whether close() was called."""
        return self._comm.closed

    def __enter__(self) -> ShmCommunicator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
