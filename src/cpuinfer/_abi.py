"""The kernel ABI stamp: a hash of the sources a kernel build is made from.

CMake runs this file as a script at configure time and compiles the result
into every variant (``_C_<variant>.ABI_STAMP``). At import the dispatcher
compares that with what the Python side expects, so a kernel built from
other sources (a stale precompiled download, a half-finished rebuild) is a
clear error instead of a crash or silently wrong results.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

# Inputs of a kernel build: every C/C++ source and header under csrc/, and the
# ISA table (flags and variant names change what a variant means).
_PATTERNS = ("csrc/**/*.h", "csrc/**/*.c", "csrc/**/*.cpp", "cmake/isa_table.json")


def source_stamp(root: Path) -> str:
    """Hash the kernel sources under ``root`` (a source checkout) into a stamp."""
    digest = hashlib.sha256()
    files = sorted({p for pattern in _PATTERNS for p in root.glob(pattern) if p.is_file()})
    for path in files:
        rel = path.relative_to(root).as_posix()
        # Normalise line endings so a checkout on Windows stamps the same.
        data = path.read_bytes().replace(b"\r\n", b"\n")
        digest.update(rel.encode() + b"\0" + str(len(data)).encode() + b"\0" + data)
    return digest.hexdigest()[:16]


def checkout_root() -> Path | None:
    """The source checkout this package runs from (editable installs), if any."""
    root = Path(__file__).resolve().parent.parent.parent
    if (root / "csrc").is_dir() and (root / "cmake" / "isa_table.json").is_file():
        return root
    return None


if __name__ == "__main__":
    print(source_stamp(Path(sys.argv[1]).resolve()))
