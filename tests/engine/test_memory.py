"""KV-cache memory: huge-page advice, checked in the kernel's own view of the mapping (/proc/self/smaps)."""

import sys
from pathlib import Path

import pytest
import torch

from cpuinfer.platform.memory import HUGE_PAGE, advise_huge_pages, zeros_huge

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")
linux_thp = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not THP.exists() or "[never]" in THP.read_text(),
    reason="needs Linux with transparent huge pages not set to 'never'",
)


def mapping_of(addr: int) -> dict:
    """The /proc/self/smaps entry (header fields and VmFlags) of the mapping that holds addr."""
    entry = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            lo, hi = (int(x, 16) for x in first.split("-"))
            entry = {"range": (lo, hi)} if lo <= addr < hi else None
        elif entry is not None:
            key, _, value = line.partition(":")
            entry[key] = value.strip()
            if key == "VmFlags":
                return entry
    raise AssertionError(f"no mapping holds {addr:#x}")


@linux_thp
def test_zeros_huge_advises_the_mapping_and_is_zero():
    t = zeros_huge((4, 8, 16, 128, 128), torch.bfloat16)  # 16 MiB
    assert t.shape == (4, 8, 16, 128, 128) and t.dtype == torch.bfloat16
    assert torch.count_nonzero(t) == 0
    flags = mapping_of(t.data_ptr() + t.nbytes // 2)["VmFlags"].split()
    assert "hg" in flags, f"MADV_HUGEPAGE not set on the cache's mapping: {flags}"


@linux_thp
def test_advise_covers_whole_huge_pages_only():
    t = torch.empty(3 * HUGE_PAGE + 12345, dtype=torch.uint8)
    n = advise_huge_pages(t)
    assert n % HUGE_PAGE == 0 and 2 * HUGE_PAGE <= n <= 3 * HUGE_PAGE


def test_small_tensors_are_left_alone():
    assert advise_huge_pages(torch.empty(1000)) == 0  # smaller than one huge page
    assert advise_huge_pages(torch.empty(0)) == 0
    assert torch.equal(zeros_huge((3, 5), torch.float32), torch.zeros(3, 5))
