"""Decode GEMV speed: our linear kernel vs torch F.linear in bf16 and f32, as ratios.

    python benchmarks/bench_linear.py [--quick] [--threads N]

SmolLM2-135M projection shapes (hidden 576, MLP 1536, vocab 49152) at M = 1
and 8 rows (decode batches), bf16 weights. Prints best-of-5 time per call of
every runnable variant, torch bf16 and torch f32 (weights pre-converted, so
f32 reads twice the bytes), and best/torch ratios. Target (exit 1 if missed):
bf16 [1, 576] x [1536, 576]^T best variant >= 1.5x torch bf16.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from bench_kernels import bench, setup_run  # same directory: best-of-5 timing, shared flags

import cpuinfer

# (N, K): q/o projection, MLP up (gate or up half), MLP down, LM head.
SHAPES = [(576, 576), (1536, 576), (576, 1536), (49152, 576)]
ROWS = [1, 8]
TARGET = ((1, 1536, 576), 1.5)


def time_shape(modules: dict, m: int, n: int, k: int, min_time: float) -> dict[str, float]:
    """Seconds per call of each variant and of torch bf16 / f32 on one shape."""
    x = torch.randn(m, k, dtype=torch.bfloat16)
    w = (torch.randn(n, k) / k**0.5).to(torch.bfloat16)
    xf, wf = x.float(), w.float()
    out = torch.empty(m, n, dtype=torch.bfloat16)
    times = {v: bench(lambda mod=mod: mod.linear(out, x, w, None), min_time) for v, mod in modules.items()}
    times["torch-bf16"] = bench(lambda: F.linear(x, w), min_time)
    times["torch-f32"] = bench(lambda: F.linear(xf, wf), min_time)
    return times


def main(argv=None) -> int:
    """Time every shape and print a table; nonzero exit if the target is missed."""
    min_time, variants, modules = setup_run(argv, __doc__.splitlines()[0])
    print(f"cpuinfer {cpuinfer.__version__}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
          f"bf16 out = x[M, K] @ W[N, K]^T; variants: {', '.join(variants)}")
    cols = [*variants, "torch-bf16", "torch-f32"]
    print(f"{'M':>3}{'N':>7}{'K':>6}" + "".join(f"{c:>12}" for c in cols) + f"{'best/bf16':>11}{'best/f32':>10}")
    failed = []
    for m in ROWS:
        for n, k in SHAPES:
            times = time_shape(modules, m, n, k, min_time)
            best = min(variants, key=lambda v: times[v])
            r16, r32 = times["torch-bf16"] / times[best], times["torch-f32"] / times[best]
            print(f"{m:>3}{n:>7}{k:>6}" + "".join(f"{times[c] * 1e6:>10.1f}us" for c in cols)
                  + f"{r16:>10.2f}x{r32:>9.2f}x  (best: {best}, {n * k * 2 / times[best] / 1e9:.1f} GB/s of W)")
            if (m, n, k) == TARGET[0] and r16 < TARGET[1]:
                failed.append(f"M={m} N={n} K={k}: {r16:.2f}x torch bf16 (want {TARGET[1]}x)")
    for f in failed:
        print(f"TARGET MISSED: {f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
