"""Kernel speed: every installed variant this CPU runs, against plain torch, in one run.

    python benchmarks/bench_kernels.py [--quick]

For rms_norm, fused_add_rms_norm, rotary (NeoX), silu_and_mul,
gelu_and_mul and argmax (greedy sampling over a 32-row step's logits,
SmolLM2's 49152-token vocabulary) on bf16 and f32 inputs, prints the best-of-5 time per call of each
variant and of a plain-torch implementation of the same op, and the ratios
best/generic and best/torch. Targets (checked, exit 1 if missed): bf16
rms_norm and silu_and_mul on [256, 4096]: best variant >= 3x generic and
>= 1.2x torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time

import torch
import torch.nn.functional as F

import cpuinfer

TARGETS = {("rms_norm", torch.bfloat16): (3.0, 1.2), ("silu_and_mul", torch.bfloat16): (3.0, 1.2)}
TOKENS, HIDDEN, HEADS, HEAD_SIZE = 256, 4096, 32, 128


def bench(fn, min_time: float, reduce=min) -> float:
    """Seconds per call over 5 repeats (each at least min_time/5 s), reduced by `reduce`: by default the best,
    the least disturbed by other load."""
    fn()
    reps = 1
    while True:  # calibrate
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        if time.perf_counter() - t0 > min_time / 5:
            break
        reps *= 2
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        samples.append((time.perf_counter() - t0) / reps)
    return reduce(samples)


def torch_rms_norm(x, w, eps=1e-6):
    """The op as a model would write it in torch (f32 math, cast back)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * w


def torch_fused_add_rms_norm(x, res, w, eps=1e-6):
    """residual += x; x = rms_norm(residual)."""
    res.add_(x)
    x.copy_(torch_rms_norm(res, w, eps))


def torch_rotary(positions, q, k, cache):
    """NeoX rotary as in vLLM's forward_native."""
    cos, sin = cache[positions].chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(-2).to(q.dtype), sin.unsqueeze(-2).to(q.dtype)
    for t in (q, k):
        v = t.view(t.shape[0], -1, HEAD_SIZE)
        a, b = v[..., : HEAD_SIZE // 2], v[..., HEAD_SIZE // 2 :]
        v.copy_(torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1))


def cases(dtype):
    """(op name, {variant-or-'torch': callable}) per op, on fresh inputs."""
    x = torch.randn(TOKENS, HIDDEN, dtype=dtype)
    w = torch.randn(HIDDEN, dtype=dtype)
    out = torch.empty_like(x)
    res = torch.randn(TOKENS, HIDDEN, dtype=dtype)
    g = torch.randn(TOKENS, 2 * HIDDEN, dtype=dtype)
    gout = torch.empty(TOKENS, HIDDEN, dtype=dtype)
    positions = torch.randint(0, 4096, (TOKENS,))
    q = torch.randn(TOKENS, HEADS * HEAD_SIZE, dtype=dtype)
    k = torch.randn(TOKENS, 8 * HEAD_SIZE, dtype=dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, HEAD_SIZE, 2).float() / HEAD_SIZE))
    freqs = torch.outer(torch.arange(4096).float(), inv)
    cache = torch.cat([freqs.cos(), freqs.sin()], -1)
    yield "rms_norm", lambda m: lambda: m.rms_norm(out, x, w, 1e-6), lambda: torch_rms_norm(x, w)
    yield (
        "fused_add_rms_norm",
        lambda m: lambda: m.fused_add_rms_norm(x, res, w, 1e-6),
        lambda: torch_fused_add_rms_norm(x, res, w),
    )
    yield (
        "rotary",
        lambda m: lambda: m.rotary_embedding(positions, q, k, HEAD_SIZE, cache, True),
        lambda: torch_rotary(positions, q, k, cache),
    )
    yield ("silu_and_mul", lambda m: lambda: m.silu_and_mul(gout, g), lambda: F.silu(g[:, :HIDDEN]) * g[:, HIDDEN:])
    yield ("gelu_and_mul", lambda m: lambda: m.gelu_and_mul(gout, g), lambda: F.gelu(g[:, :HIDDEN]) * g[:, HIDDEN:])
    logits = torch.randn(32, 49152, dtype=dtype)
    picked = torch.empty(32, dtype=torch.int64)
    yield ("argmax", lambda m: lambda: m.argmax(picked, logits), lambda: logits.argmax(-1))


def setup_run(argv, description: str) -> tuple[float, list[str], dict]:
    """Shared command line (--quick, --threads): returns min_time, runnable variants, their modules."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--quick", action="store_true", help="shorter timing (noisier)")
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch/kernel threads (default: torch's); 1 gives stable numbers on a busy machine",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = runnable_variants()
    return (0.1 if args.quick else 0.4), variants, variant_modules(variants)


def runnable_variants() -> list[str]:
    """The installed kernel variants this CPU can run."""
    return [c.name for c in cpuinfer._selection.candidates if c.installed and c.runnable]


def variant_modules(names: list[str]) -> dict:
    """Each variant's kernel module, by name."""
    return {v: importlib.import_module(f"cpuinfer._C_{v}") for v in names}


def main(argv=None) -> int:
    """Run every case and print a table; nonzero exit if a target is missed."""
    min_time, variants, modules = setup_run(argv, __doc__.splitlines()[0])
    print(
        f"cpuinfer {cpuinfer.__version__}; torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"[{TOKENS}, {HIDDEN}] inputs; variants: {', '.join(variants)}"
    )
    header = f"{'op':<20}{'dtype':<10}" + "".join(f"{v:>12}" for v in [*variants, "torch"])
    print(header + f"{'best/generic':>14}{'best/torch':>12}")
    failed = []
    for dtype in (torch.bfloat16, torch.float32):
        for name, make, ref in cases(dtype):
            times = {v: bench(make(modules[v]), min_time) for v in variants}
            times["torch"] = bench(ref, min_time)
            best = min(variants, key=lambda v: times[v])
            vs_generic = times["generic"] / times[best] if "generic" in times else float("nan")
            vs_torch = times["torch"] / times[best]
            row = f"{name:<20}{str(dtype).split('.')[-1]:<10}" + "".join(
                f"{times[v] * 1e6:>10.1f}us" for v in [*variants, "torch"]
            )
            print(row + f"{vs_generic:>13.2f}x{vs_torch:>11.2f}x  (best: {best})")
            target = TARGETS.get((name, dtype))
            if target and (vs_generic < target[0] or vs_torch < target[1]):
                failed.append(
                    f"{name} {dtype}: {vs_generic:.2f}x generic (want {target[0]}x), "
                    f"{vs_torch:.2f}x torch (want {target[1]}x)"
                )
    for f in failed:
        print(f"TARGET MISSED: {f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
