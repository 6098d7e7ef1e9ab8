"""Print /proc/cpuinfo as Linux would write it for the aarch64 CPU this runs on (one processor).

    qemu-aarch64 -cpu cortex-a72 python3.11 aarch64_cpuinfo.py > cpuinfo

qemu-user shows the host's /proc/cpuinfo, but the variant providers read it: uv's for the core (CPU implementer
and part), provider-variant-aarch64 (archspec) for those and the Features line. Both come from the CPU as the
program sees it: the MIDR_EL1 register (`mrs`, which Linux and qemu emulate for user space when the cpuid hwcap is
set) and the AT_HWCAP/AT_HWCAP2 bits, named as Linux names them (arch/arm64/include/uapi/asm/hwcap.h).
"""

from __future__ import annotations

import ctypes
import mmap
import struct

HWCAP = [
    "fp",
    "asimd",
    "evtstrm",
    "aes",
    "pmull",
    "sha1",
    "sha2",
    "crc32",
    "atomics",
    "fphp",
    "asimdhp",
    "cpuid",
    "asimdrdm",
    "jscvt",
    "fcma",
    "lrcpc",
    "dcpop",
    "sha3",
    "sm3",
    "sm4",
    "asimddp",
    "sha512",
    "sve",
    "asimdfhm",
    "dit",
    "uscat",
    "ilrcpc",
    "flagm",
    "ssbs",
    "sb",
    "paca",
    "pacg",
]
HWCAP2 = [
    "dcpodp",
    "sve2",
    "sveaes",
    "svepmull",
    "svebitperm",
    "svesha3",
    "svesm4",
    "flagm2",
    "frint",
    "svei8mm",
    "svef32mm",
    "svef64mm",
    "svebf16",
    "i8mm",
    "bf16",
    "dgh",
    "rng",
    "bti",
    "mte",
]
AT_HWCAP, AT_HWCAP2 = 16, 26


def midr() -> int:
    """MIDR_EL1, read by a two-instruction function (mrs x0, midr_el1; ret)."""
    code = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    code.write(struct.pack("<II", 0xD5380000, 0xD65F03C0))
    return ctypes.CFUNCTYPE(ctypes.c_uint64)(ctypes.addressof(ctypes.c_char.from_buffer(code)))()


def main() -> None:
    """Print the file."""
    getauxval = ctypes.CDLL(None).getauxval
    getauxval.restype, getauxval.argtypes = ctypes.c_ulong, [ctypes.c_ulong]
    caps, caps2 = getauxval(AT_HWCAP), getauxval(AT_HWCAP2)
    # evtstrm is the kernel's (its timer event stream, on in every arm64 Linux), not the CPU's: qemu-user has none
    caps |= 1 << HWCAP.index("evtstrm")
    features = [n for i, n in enumerate(HWCAP) if caps >> i & 1] + [n for i, n in enumerate(HWCAP2) if caps2 >> i & 1]
    m = midr() if "cpuid" in features else 0
    print(
        f"processor\t: 0\nFeatures\t: {' '.join(features)}\nCPU implementer\t: 0x{m >> 24 & 0xFF:02x}\n"
        f"CPU architecture: 8\nCPU variant\t: 0x{m >> 20 & 0xF:x}\nCPU part\t: 0x{m >> 4 & 0xFFF:03x}\n"
        f"CPU revision\t: {m & 0xF}\n"
    )


if __name__ == "__main__":
    main()
