"""Transparent huge pages for the KV cache and the weights.

Paged attention reads the cache block by block at scattered places. With 4 KiB
pages a block of one KV head (2-32 KiB) spans one to eight pages, so nearly
every block costs TLB misses, and the hardware prefetcher stops at every page
edge. Backed by 2 MiB pages the same reads run ~10-14% faster (32 x 1024-token
decode on a 2-core Zen 3, block sizes 16 and 128).

A decode step streams every weight once, so the same holds for the packed
weights: ModelRunner builds the model inside weight_arena(), and
ops.pack_weight takes its output from there: the packed bf16/f16 weights are
carved out of huge-page chunks one after another. Measured on 2 Sapphire
Rapids cores (SmolLM2 bf16, its 121 projections at 32 rows, alternating
rounds): 24.4 -> 18.0 ms a pass over the weights (12.4 -> 15.8 GB/s), and
batch-1 decode 42-55 -> 60-67 tok/s in alternating engine runs; packing the
same weights into one buffer of 4 KiB pages gained nothing, so the pages are
what matters, not the contiguity. Quantized weights stay where the loader put
them: they are built in parts that are concatenated (q, k, v), and a dead part
in a chunk would stay resident as long as the chunk does (SmolLM2 Q4_1 decode
measured no faster in huge pages, its 75 MB of weights mostly in cache).

Linux gives anonymous memory huge pages when THP is "always", or "madvise" (a
common default) and the range was advised before it was touched; elsewhere
this is a no-op and the arena hands out plain tensors.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import logging
import mmap
import sys
from collections.abc import Iterator
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20


def huge_page_bytes(nbytes: int) -> torch.Tensor:
    """nbytes of zeroed memory as a uint8 tensor starting on a 2 MiB boundary, in an anonymous mapping of its
    own, advised for huge pages (Linux's MADV_HUGEPAGE) before anything touches it.

    Why a mapping of its own rather than torch.empty: glibc serves even a 64 MiB request from the heap when
    the heap has that much free (it does after a model load's temporaries are gone), and such memory (a)
    has been touched already, so the advice comes too late to back it with huge pages, and (b) stays with
    the heap after it is freed. The tensor and every view of it keep the mapping; the last one gone unmaps
    it. Only the tensor's own range is advised, so it is a mapping entry of its own (/proc/self/smaps).
    """
    if nbytes <= 0:
        return torch.zeros(0, dtype=torch.uint8)
    # Private: a shared anonymous mapping is shmem, whose huge pages follow shmem_enabled, not the advice.
    # (Without a file, mmap adds MAP_ANONYMOUS itself.)
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE)
    whole = torch.frombuffer(region, dtype=torch.uint8)
    lead = -whole.data_ptr() % HUGE_PAGE  # whole pages: the mapping starts on one
    if hasattr(mmap, "MADV_HUGEPAGE"):  # Linux
        with contextlib.suppress(OSError):  # a kernel built without THP refuses: small pages, not an error
            region.madvise(mmap.MADV_HUGEPAGE, lead, nbytes)
    return whole[lead : lead + nbytes]


def zeros_huge(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype=dtype), backed by huge pages where the OS offers them (from one huge page up).

    Not written here: a fresh anonymous mapping reads as zeros, and its pages are faulted in (as huge pages,
    the range being advised) when a KV block is first written. Writing the whole cache up front cost the
    bundled 135M model's start 8-13 s of system time and 4.5 GB resident for the default 4 GiB cache; now
    resident memory follows the blocks in use (the block pool hands out the lowest ids first and reuses the
    last freed). That the cache fits the machine is checked before anything is mapped
    (check_fits_memory), since a fault cannot fail cleanly later."""
    shape = torch.Size(shape)
    nbytes = shape.numel() * dtype.itemsize
    if nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    return huge_page_bytes(nbytes).view(dtype).view(shape)


def available_memory_bytes() -> int | None:
    """Memory this process may still use: Linux's MemAvailable, capped by a cgroup v2 limit; None if unknown."""
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    except (OSError, ValueError, IndexError):
        return None
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text().strip())
        if limit.isdigit() and avail is not None:
            avail = min(avail, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass  # no cgroup v2 limit readable: MemAvailable alone
    return avail


def fit_kv_cache(num_blocks: int, block_bytes: int, space_gib: float) -> int:
    """num_blocks, checked against the memory available before anything is mapped (the cache's pages are
    faulted in as blocks are used, so a cache too big would fail at some later request instead).

    A VLLM_CPU_KVCACHE_SPACE set larger than the memory available is an error naming it; the default (unset)
    shrinks to half the memory available, with a warning, so that a small machine still starts."""
    avail = available_memory_bytes()
    need = num_blocks * block_bytes
    if avail is None or need <= avail:
        return num_blocks
    from cpuinfer import envs

    found = envs.KVCACHE_SPACE.raw()
    if found is not None:
        name, value = found
        raise ValueError(
            f"{name}={value} GiB: the KV cache ({need / 2**30:.2f} GiB over all ranks) does not fit the "
            f"{avail / 2**30:.2f} GiB of memory available; lower {name}"
        )
    fitted = max(1, avail // 2 // block_bytes)
    logging.getLogger("cpuinfer.config").warning(
        "KV cache: the default %g GiB exceeds the %.2f GiB of memory available; using %.2f GiB "
        "(set VLLM_CPU_KVCACHE_SPACE to choose)",
        space_gib,
        avail / 2**30,
        fitted * block_bytes / 2**30,
    )
    return fitted


def release_free_heap() -> bool:
    """Give the memory the C heap holds free back to the OS (glibc's malloc_trim; False where there is none).

    glibc keeps freed heap memory mapped for reuse. A model load frees a lot of it (the checkpoint's
    tensors once they are packed: SmolLM2 bf16's engine held 1257 MB resident after its load, 1031 MB
    after this), and an engine does not allocate on that scale again, so ModelRunner calls it after the
    load, before the KV cache is made."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except AttributeError:  # not glibc (macOS, musl)
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


@functools.cache
def huge_pages_available() -> bool:
    """True on Linux with transparent huge pages set to "always" or "madvise" (not "never", not absent)."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        mode = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return False
    return "[always]" in mode or "[madvise]" in mode


class HugePageArena:
    """Tensors carved one after another out of huge-page-backed chunks (a bump allocator).

    A chunk is a huge_page_bytes() mapping; each tensor handed out is a view of it at a 4 KiB boundary, so a
    chunk lives as long as any tensor cut from it, and is unmapped when the last one is gone (the arena
    itself keeps only the chunk it is filling). Pages are backed when first written, so the
    unused tail of a chunk costs address space, not memory (at most one partly used huge page). A tensor
    larger than the chunk size gets a chunk of its own.
    """

    ALIGN = 4096  # every tensor starts on a page (torch's allocator gives 64 bytes; the kernels need 64)

    def __init__(self, chunk_bytes: int = 64 << 20):
        if chunk_bytes <= 0 or chunk_bytes % HUGE_PAGE:
            raise ValueError(f"chunk_bytes must be a positive multiple of {HUGE_PAGE}, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None
        self._used = self._end = 0  # byte offsets in _chunk: the next tensor's start, the usable end
        self.chunks = 0  # chunks made so far

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous tensor of shape and dtype in huge-page-backed memory."""
        shape = torch.Size(shape)
        nbytes = shape.numel() * dtype.itemsize
        size = -(-max(nbytes, 1) // self.ALIGN) * self.ALIGN
        if self._chunk is None or self._used + size > self._end:
            self._chunk = huge_page_bytes(max(self.chunk_bytes, -(-size // HUGE_PAGE) * HUGE_PAGE))
            self._used, self._end = 0, self._chunk.numel()
            self.chunks += 1
        t = self._chunk[self._used : self._used + nbytes].view(dtype).view(shape)
        self._used += size
        return t


_weight_arena: contextvars.ContextVar[HugePageArena | None] = contextvars.ContextVar("weight_arena", default=None)


@contextlib.contextmanager
def weight_arena() -> Iterator[HugePageArena | None]:
    """Inside it, empty_weight() allocates from a fresh HugePageArena (none where huge pages are unavailable).

    The arena is dropped on exit; the tensors made in it keep their chunks alive."""
    arena = HugePageArena() if huge_pages_available() else None
    token = _weight_arena.set(arena)
    try:
        yield arena
    finally:
        _weight_arena.reset(token)


def empty_weight(shape, dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype=dtype): from the active weight_arena() if there is one, else a plain tensor."""
    arena = _weight_arena.get()
    return torch.empty(shape, dtype=dtype) if arena is None else arena.empty(shape, dtype)
