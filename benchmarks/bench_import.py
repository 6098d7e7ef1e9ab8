"""Import cost: `import cpuinfer` against `import torch`, in fresh interpreters.

Target: cpuinfer (probe + dispatch + loading one variant) adds at most 100 ms
to torch's own import. Each side is timed as the best of several runs, with
the two interleaved so that machine noise hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

CODE = "import time; t = time.perf_counter(); import {mod}; print(time.perf_counter() - t)"


def once(module: str) -> float:
    """Seconds for `import module` in a new interpreter (interpreter start-up excluded)."""
    out = subprocess.run([sys.executable, "-c", CODE.format(mod=module)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip())


def main() -> int:
    """Time both imports and print the difference against the 100 ms budget."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    torch_t, ours_t = [], []
    for _ in range(args.runs):
        torch_t.append(once("torch"))
        ours_t.append(once("cpuinfer"))
    best_torch, best_ours = min(torch_t), min(ours_t)
    extra_ms = (best_ours - best_torch) * 1000
    print(f"import torch     best {best_torch * 1000:7.1f} ms   median {statistics.median(torch_t) * 1000:7.1f} ms")
    print(f"import cpuinfer  best {best_ours * 1000:7.1f} ms   median {statistics.median(ours_t) * 1000:7.1f} ms")
    verdict = "OK" if extra_ms <= 100 else "OVER BUDGET"
    print(f"cpuinfer adds {extra_ms:.1f} ms to torch's import (budget 100 ms): {verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
