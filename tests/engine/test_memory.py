"""KV-cache and weight memory: huge-page advice, checked in the kernel's own view of the mapping (/proc/self/smaps)."""

import ctypes
import gc
import itertools
import sys
from pathlib import Path

import pytest
import torch

from cpuinfer.platform.memory import (
    HUGE_PAGE,
    HugePageArena,
    empty_weight,
    huge_page_bytes,
    huge_pages_available,
    release_free_heap,
    weight_arena,
    zeros_huge,
)

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
linux_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="needs Linux with transparent huge pages not set to 'never'",
)


def mappings() -> list[dict]:
    """Every /proc/self/smaps entry: its address range and its header fields (VmFlags among them)."""
    entries = []
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            lo, hi = (int(x, 16) for x in first.split("-"))
            entries.append({"range": (lo, hi)})
        elif entries:
            key, _, value = line.partition(":")
            entries[-1][key] = value.strip()
    return entries


def mapping_of(addr: int) -> dict:
    """The /proc/self/smaps entry of the mapping that holds addr."""
    for entry in mappings():
        if entry["range"][0] <= addr < entry["range"][1]:
            return entry
    raise AssertionError(f"no mapping holds {addr:#x}")


@linux_thp
def test_zeros_huge_advises_the_mapping_and_is_zero():
    t = zeros_huge((4, 8, 16, 128, 128), torch.bfloat16)  # 16 MiB
    assert t.shape == (4, 8, 16, 128, 128) and t.dtype == torch.bfloat16
    # Not faulted in up front: resident memory follows the KV blocks written, not the cache's size.
    assert int(mapping_of(t.data_ptr())["Rss"].split()[0]) == 0
    assert torch.count_nonzero(t) == 0
    flags = mapping_of(t.data_ptr() + t.nbytes // 2)["VmFlags"].split()
    assert "hg" in flags, f"MADV_HUGEPAGE not set on the cache's mapping: {flags}"


def thp_fault_fallbacks() -> int:
    """How many times this system's kernel wanted a huge page at a page fault and had to use small pages."""
    for line in Path("/proc/vmstat").read_text().splitlines():
        if line.startswith("thp_fault_fallback "):
            return int(line.split()[1])
    return 0


@linux_thp
def test_huge_page_bytes_is_a_mapping_of_its_own_backed_by_huge_pages():
    """Not torch.empty: glibc may serve a big request from its heap, memory touched before the advice
    and kept by the heap after it is freed."""
    t = huge_page_bytes(8 * HUGE_PAGE)
    assert t.dtype == torch.uint8 and t.numel() == 8 * HUGE_PAGE and t.data_ptr() % HUGE_PAGE == 0
    assert torch.count_nonzero(t) == 0
    m = mapping_of(t.data_ptr())
    assert m["range"] == (t.data_ptr(), t.data_ptr() + t.nbytes) and "hg" in m["VmFlags"].split()
    fallbacks = thp_fault_fallbacks()
    t.fill_(1)  # first touch: the kernel backs advised, aligned ranges with huge pages (if it has any free)
    if int(mapping_of(t.data_ptr())["AnonHugePages"].split()[0]) == 0:
        # The advice worked if the kernel tried: a fallback to small pages means it had no free huge page.
        if thp_fault_fallbacks() > fallbacks:
            pytest.skip("the kernel had no free huge page (thp_fault_fallback rose)")
        raise AssertionError("no huge page in an advised, aligned, written 16 MiB range")


@linux_thp
def test_zeros_huge_faults_in_only_what_is_written():
    t = zeros_huge((64, HUGE_PAGE // 4), torch.float32)  # 128 MiB, one huge page per row
    fallbacks = thp_fault_fallbacks()
    t[3].fill_(1.0)
    m = mapping_of(t.data_ptr())
    assert 0 < int(m["Rss"].split()[0]) <= 2 * HUGE_PAGE // 1024, m["Rss"]
    # The row written is backed by a huge page (the advantage the cache was advised for), unless the kernel
    # had none free.
    if int(m["AnonHugePages"].split()[0]) == 0 and thp_fault_fallbacks() == fallbacks:
        raise AssertionError("the first write to an advised cache row got no huge page")


def test_too_large_kv_cache_is_one_line_naming_the_variable(monkeypatch):
    from cpuinfer.platform.memory import fit_kv_cache

    monkeypatch.setattr("cpuinfer.platform.memory.available_memory_bytes", lambda: 2 << 30)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "100")
    with pytest.raises(ValueError, match=r"VLLM_CPU_KVCACHE_SPACE=100 GiB.*2\.00 GiB of memory available"):
        fit_kv_cache(100 * 1024, 1 << 20, 100.0)
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    monkeypatch.delenv("CPUINFER_KVCACHE_SPACE", raising=False)
    # The default shrinks to half of what is available (a warning says so) instead of failing.
    assert fit_kv_cache(4 * 1024, 1 << 20, 4.0) == 1024
    assert fit_kv_cache(512, 1 << 20, 4.0) == 512


def test_small_tensors_are_plain_zeros():
    assert torch.equal(zeros_huge((3, 5), torch.float32), torch.zeros(3, 5))  # smaller than one huge page
    assert huge_page_bytes(0).numel() == 0


def vm_rss_kib() -> int:
    return int(Path("/proc/self/status").read_text().split("VmRSS:")[1].split()[0])


glibc = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(ctypes.CDLL(None), "malloc_trim"), reason="needs glibc"
)


@glibc
def test_release_free_heap_returns_freed_heap_memory():
    # 100 MiB in 64 KiB tensors: below glibc's mmap threshold, so on the heap; one more pins the heap's top,
    # so freeing the rest leaves them free in its middle, where glibc keeps them resident.
    parts = [torch.ones(1 << 14) for _ in range(1600)]
    pin = torch.ones(1 << 14)
    del parts
    gc.collect()
    before = vm_rss_kib()
    assert release_free_heap()
    assert before - vm_rss_kib() > 50 << 10, "malloc_trim gave back less than half of 100 MiB freed"
    assert torch.equal(pin, torch.ones(1 << 14))


# The weight arena: packed weights carved out of huge-page chunks (platform.memory.HugePageArena).


def test_arena_tensors_are_separate_aligned_and_hold_their_values():
    arena = HugePageArena(chunk_bytes=HUGE_PAGE)
    shapes = [((3, 5), torch.float32), ((1000, 7), torch.bfloat16), ((0, 4), torch.float16), ((4096,), torch.uint8)]
    made = [(arena.empty(shape, dtype), shape, dtype) for shape, dtype in shapes]
    spans = []
    for i, (t, shape, dtype) in enumerate(made):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert t.data_ptr() % HugePageArena.ALIGN == 0
        t.fill_(i + 1)
        spans.append((t.data_ptr(), t.data_ptr() + t.nbytes))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), f"arena tensors overlap: {spans}"
    for i, (t, _, _) in enumerate(made):  # no write reached another tensor
        assert torch.all(t == i + 1)


def test_arena_starts_a_chunk_when_full_and_gives_big_tensors_their_own():
    arena = HugePageArena(chunk_bytes=HUGE_PAGE)
    a = arena.empty((HUGE_PAGE // 2,), torch.uint8)
    b = arena.empty((HUGE_PAGE // 2,), torch.uint8)  # fills the first chunk exactly
    assert arena.chunks == 1 and b.data_ptr() == a.data_ptr() + HUGE_PAGE // 2
    c = arena.empty((1,), torch.uint8)
    assert arena.chunks == 2 and c.data_ptr() % HUGE_PAGE == 0  # a new chunk starts on a huge page
    big = arena.empty((3 * HUGE_PAGE + 1,), torch.uint8)
    assert arena.chunks == 3 and big.numel() == 3 * HUGE_PAGE + 1
    big.fill_(7)  # the whole of it is writable
    assert int(big[-1]) == 7


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/smaps")
def test_arena_chunks_live_as_long_as_their_tensors():
    """The arena keeps only the chunk it fills: a tensor keeps its chunk (values intact after the arena is
    gone), and once the last tensor of a chunk is gone the chunk's mapping goes back to the system."""
    arena = HugePageArena()
    t = arena.empty((1024,), torch.float32)
    t.copy_(torch.arange(1024, dtype=torch.float32))
    chunk = mapping_of(t.data_ptr())["range"]
    if huge_pages_available():  # the advised part of the chunk's own mapping is a mapping of its own
        assert chunk == (t.data_ptr(), t.data_ptr() + arena.chunk_bytes)
    del arena
    gc.collect()
    churn = [torch.full((HUGE_PAGE // 4,), -1.0) for _ in range(8)]  # reuse of freed memory would show here
    assert torch.equal(t, torch.arange(1024, dtype=torch.float32))
    assert mapping_of(t.data_ptr())["range"] == chunk
    del churn, t
    gc.collect()
    # Its mapping is gone. (Not "nothing maps its addresses": another thread of a test process, or reading
    # smaps itself, may map memory into the freed range; none makes a mapping of exactly its extent.)
    assert chunk not in [m["range"] for m in mappings()]


def test_arena_refuses_a_chunk_size_off_huge_pages():
    for bad in (0, -HUGE_PAGE, HUGE_PAGE + 4096):
        with pytest.raises(ValueError, match="multiple of"):
            HugePageArena(chunk_bytes=bad)


def test_empty_weight_uses_the_active_arena_only():
    outside = empty_weight((64, 64), torch.bfloat16)
    assert outside.shape == (64, 64) and outside.dtype == torch.bfloat16
    with weight_arena() as arena:
        if arena is None:
            assert not huge_pages_available()
            return
        x = empty_weight((64, 64), torch.bfloat16)
        y = empty_weight((64, 64), torch.bfloat16)
        assert arena.chunks == 1
        assert y.data_ptr() - x.data_ptr() == x.nbytes  # one after another in its chunk (8 KiB, two pages)
    assert empty_weight((8,), torch.float32).shape == (8,)  # the arena is gone: plain tensors again


@linux_thp
def test_arena_chunks_are_advised_for_huge_pages():
    assert huge_pages_available()
    with weight_arena():
        t = empty_weight((4 * HUGE_PAGE,), torch.uint8)
    flags = mapping_of(t.data_ptr() + t.nbytes // 2)["VmFlags"].split()
    assert "hg" in flags, f"MADV_HUGEPAGE not set on the arena's chunk: {flags}"


@linux_thp
def test_model_runner_packs_its_weights_in_huge_pages(monkeypatch):
    """A bf16 model's packed projections and lm_head lie in advised mappings (the bundled SmolLM2, dense)."""
    from cpuinfer.config import default_model_path
    from cpuinfer.model_loader import load_model_spec
    from cpuinfer.worker.model_runner import ModelRunner

    monkeypatch.setenv("CPUINFER_GGUF_DEQUANTIZE", "1")  # dense bf16 weights, packed for the GEMM
    runner = ModelRunner(load_model_spec(default_model_path(), "bfloat16"), 16, 8, torch.bfloat16)
    layer = runner.model.layers[0]
    assert layer.plan.packed and runner.model.head.packed
    for w in (
        layer.plan.attn.qkv_w,
        layer.plan.attn.o_w,
        layer.plan.mlp.gate_up_w,
        layer.plan.mlp.down_w,
        runner.model.head.lm_head,
    ):
        assert w.dtype == torch.bfloat16
        flags = mapping_of(w.data_ptr())["VmFlags"].split()
        assert "hg" in flags, f"a packed weight {tuple(w.shape)} is not in huge-page memory: {flags}"
