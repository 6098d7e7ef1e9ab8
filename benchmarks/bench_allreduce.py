"""All-reduce latency between two tensor-parallel ranks: the shared-memory communicator against gloo, one run.

    python benchmarks/bench_allreduce.py [--quick] [--cpus auto|0,1|none]

Two spawned processes, each pinned to its own core with one thread, all-reduce bf16 tensors of 1 x hidden to
32 x hidden (hidden 576 and 4096) in place, through cpuinfer's ShmCommunicator (the Python call, as the model
makes it) and through torch.distributed with the gloo backend (file:// store), in the same run. Prints rank 0's
median time per call over 5 repeats, and gloo / shm. Targets (checked, exit 1 if missed): >= 10x gloo at
decode sizes (up to 8 rows) and <= 10 us for 1 x 4096 bf16.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

import cpuinfer
from cpuinfer.distributed.shm import ShmCommunicator, unique_name

HIDDENS = (576, 4096)
ROWS = (1, 2, 4, 8, 16, 32)
DECODE_ROWS = 8
TARGET_RATIO = 10.0
TARGET_1X4096_US = 10.0


def time_calls(fn, iters: int, barrier) -> float:
    """Median seconds per call of fn over 5 repeats of `iters` calls, the ranks starting each repeat together."""
    for _ in range(max(10, iters // 10)):  # warm up
        fn()
    samples = []
    for _ in range(5):
        barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


def rank_main(rank: int, cpu: int | None, shm_name: str, store: str, quick: bool, results) -> None:
    """One rank: pin, join both communicators, time every size, send rank 0's table to the parent."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    torch.set_num_threads(1)
    comm = ShmCommunicator(shm_name, rank, 2)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=2)
    rows_out = []
    scale = 0.25 if quick else 1.0
    for hidden in HIDDENS:
        for rows in ROWS:
            t = torch.zeros(rows, hidden, dtype=torch.bfloat16)  # zeros: the sums stay finite, call after call
            shm = time_calls(lambda t=t: comm.all_reduce_(t), int(4000 * scale), comm.barrier)
            gloo = time_calls(lambda t=t: dist.all_reduce(t), int(400 * scale), comm.barrier)
            rows_out.append((hidden, rows, shm, gloo))
    dist.destroy_process_group()
    comm.close()
    if rank == 0:
        results.put(rows_out)


def main(argv=None) -> int:
    """Run both ranks, print the table, check the targets."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer calls per size (noisier)")
    ap.add_argument(
        "--cpus", default="auto", help="two cores to pin the ranks to; auto: the first two this process may use"
    )
    args = ap.parse_args(argv)
    if args.cpus == "auto":
        allowed = sorted(os.sched_getaffinity(0))
        args.cpus = ",".join(map(str, allowed[:2])) if len(allowed) >= 2 else "none"
    cpus = [None, None] if args.cpus == "none" else [int(c) for c in args.cpus.split(",")]
    if len(cpus) != 2:
        ap.error("--cpus takes two core ids")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = f"file://{tmp}/gloo-store"
        name = unique_name()
        procs = [ctx.Process(target=rank_main, args=(r, cpus[r], name, store, args.quick, results)) for r in range(2)]
        for p in procs:
            p.start()
        table = results.get(timeout=600)
        for p in procs:
            p.join(timeout=60)
    print(
        f"cpuinfer {cpuinfer.__version__} ({cpuinfer._C.VARIANT}); torch {torch.__version__}; 2 ranks on cpus "
        f"{args.cpus}, 1 thread each; bf16, in place; median of 5 repeats, rank 0"
    )
    print(f"{'hidden':>7}{'rows':>6}{'bytes':>9}{'shm':>11}{'gloo':>11}{'gloo/shm':>10}")
    failed = []
    for hidden, rows, shm, gloo in table:
        ratio = gloo / shm
        print(f"{hidden:>7}{rows:>6}{rows * hidden * 2:>9}{shm * 1e6:>9.2f}us{gloo * 1e6:>9.2f}us{ratio:>9.1f}x")
        if rows <= DECODE_ROWS and ratio < TARGET_RATIO:
            failed.append(f"{rows} x {hidden}: {ratio:.1f}x gloo (want >= {TARGET_RATIO:.0f}x)")
        if (rows, hidden) == (1, 4096):
            one = shm * 1e6
    print(
        f"target: >= {TARGET_RATIO:.0f}x gloo up to {DECODE_ROWS} rows: {'missed' if failed else 'met'}; "
        f"1 x 4096 <= {TARGET_1X4096_US:.0f} us: {one:.2f} us, {'met' if one <= TARGET_1X4096_US else 'missed'}"
    )
    if one > TARGET_1X4096_US:
        failed.append(f"1 x 4096: {one:.2f} us (want <= {TARGET_1X4096_US:.0f} us)")
    for f in failed:
        print(f"TARGET MISSED: {f}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
