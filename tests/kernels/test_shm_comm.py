"""The shared-memory communicator between tensor-parallel ranks (processes), against torch.

Ranks are spawned processes. All-reduce must equal torch's float32 sum in rank order rounded once to the
dtype, bit for bit, on every rank; all-gather equals torch.cat and broadcast the root's tensor. A rank that
dies or never arrives makes the others raise within seconds, and no segment is left in /dev/shm.

Process starts (torch + cpuinfer imports) are the cost here, so each world size runs all its cases, for every
variant this CPU runs, in one group of processes; the children build the torch reference themselves from the
same seeds and report hashes, so little crosses the pipes.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import multiprocessing as mp
import os
import queue
import signal
import threading
import time

import pytest
import torch

import cpuinfer
from cpuinfer.distributed.shm import ShmCommunicator, unique_name

from ..conftest import RUNNABLE

CTX = mp.get_context("spawn")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
SMALL_BUFFER = 4096  # 2 KiB per chunk: forces chunking at every size above 512 float32 elements
BIG_BUFFER = 4 << 20  # 2 MiB chunks: the reduce-scatter path, parallel sums, several chunks for the largest size
SIZES = [1, 7, 4096, 4097, 70_001, 1_500_001]


def shm_path(name: str) -> str:
    """Where Linux keeps a POSIX shared-memory segment of that name."""
    return "/dev/shm/" + name.lstrip("/")


def rank_tensor(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank `rank`'s input of a case: the same bits in every process that asks (a fresh copy)."""
    return _rank_tensor(seed, rank, numel, dtype).clone()


@functools.lru_cache(maxsize=64)
def _rank_tensor(seed: int, rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    return (torch.randn(numel, generator=g) * 4).to(dtype)


@functools.lru_cache(maxsize=64)
def reference_sum(seed: int, world: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """torch: the float32 sum in rank order, rounded once to dtype."""
    acc = _rank_tensor(seed, 0, numel, dtype).to(torch.float32, copy=True)  # never the cached tensor itself
    for r in range(1, world):
        acc += _rank_tensor(seed, r, numel, dtype).float()
    return acc.to(dtype)


def digest(t: torch.Tensor) -> str:
    """Hash of a tensor's bits."""
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _entry(target, rank: int, world: int, results, args) -> None:
    try:
        results.put((rank, ("ok", target(rank, world, *args))))
    except BaseException as exc:  # noqa: BLE001 - sent to the test, which fails on it with the message
        results.put((rank, ("error", f"{type(exc).__name__}: {exc}")))


def run_ranks(world: int, target, *args, timeout: float = 60.0) -> tuple[dict, list]:
    """Run target(rank, world, *args) in `world` spawned processes; ({rank: (status, value)}, exit codes).

    Bounded: processes still alive after `timeout` are killed."""
    results = CTX.Queue()
    procs = [CTX.Process(target=_entry, args=(target, r, world, results, args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict = {}
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and len(got) < world:
            try:
                rank, value = results.get(timeout=0.2)
                got[rank] = value
            except queue.Empty:
                if not any(p.is_alive() for p in procs):
                    break
        while True:  # what the last processes put before exiting
            try:
                rank, value = results.get(timeout=0.2)
                got[rank] = value
            except queue.Empty:
                break
    finally:
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return got, [p.exitcode for p in procs]


# --- correctness: every collective, every dtype and size, every variant --------------------------------


def _collectives(rank: int, world: int, names: list[str], variants: list[str]) -> dict:
    torch.set_num_threads(2 if world == 2 else 1)  # world 2 also takes the parallel copy/sum path
    out: dict = {}
    for v_index, variant in enumerate(variants):
        mod = importlib.import_module(f"cpuinfer._C_{variant}")
        big = mod.ShmComm(names[2 * v_index], rank, world, BIG_BUFFER, 30.0)
        small = mod.ShmComm(names[2 * v_index + 1], rank, world, SMALL_BUFFER, 30.0)
        assert (big.rank, big.world_size, small.buffer_bytes) == (rank, world, SMALL_BUFFER)
        for comm_name, comm in (("big", big), ("small", small)):
            for d_index, dtype in enumerate(DTYPES):
                for numel in SIZES:
                    if comm_name == "small" and numel > 70_001:
                        continue  # 700 chunks of 2 KiB: slow under process contention, and nothing new
                    seed = d_index * 100 + SIZES.index(numel)
                    t = rank_tensor(seed, rank, numel, dtype)
                    comm.all_reduce_(t)
                    ref = reference_sum(seed, world, numel, dtype)
                    key = f"{variant}/{comm_name}/all_reduce/{dtype}/{numel}"
                    out[key] = (digest(t), torch.equal(t.view(torch.uint8), ref.view(torch.uint8)))
            # all-gather: out holds [world, *shape] in rank order, any dtype
            for numel, dtype in ((1, torch.int64), (4097, torch.float32), (333, torch.bfloat16)):
                mine = rank_tensor(7, rank, numel, torch.float32).to(dtype)
                gathered = torch.empty(world, numel, dtype=dtype)
                comm.all_gather(mine, gathered)
                ref = torch.stack([rank_tensor(7, r, numel, torch.float32).to(dtype) for r in range(world)])
                key = f"{variant}/{comm_name}/all_gather/{dtype}/{numel}"
                out[key] = (digest(gathered), torch.equal(gathered, ref))
            # broadcast from every root
            for root in range(world):
                t = rank_tensor(11, rank, 4097, torch.float32)
                comm.broadcast_(t, root)
                ok = torch.equal(t, rank_tensor(11, root, 4097, torch.float32))
                out[f"{variant}/{comm_name}/broadcast/{root}"] = (digest(t), ok)
            comm.barrier()
        big.close()
        small.close()
        big.close()  # idempotent
    # The Python wrapper (the selected variant): gather along a dimension.
    with ShmCommunicator(names[-1], rank, world, buffer_bytes=SMALL_BUFFER) as comm:
        x = rank_tensor(13, rank, 5 * 7, torch.float32).view(5, 7)
        parts = [rank_tensor(13, r, 5 * 7, torch.float32).view(5, 7) for r in range(world)]
        for dim in (0, 1, -1):
            g = comm.all_gather(x, dim=dim)
            out[f"wrapper/all_gather/dim{dim}"] = (digest(g), torch.equal(g, torch.cat(parts, dim=dim)))
        y = rank_tensor(14, rank, 64, torch.bfloat16)
        assert comm.all_reduce_(y) is y
        out["wrapper/all_reduce"] = (digest(y), torch.equal(y, reference_sum(14, world, 64, torch.bfloat16)))
        assert isinstance(comm.native, cpuinfer._C.ShmComm) and comm.native.world_size == world
        z = torch.full((3,), float(rank))
        assert comm.broadcast_(z, root=world - 1) is z
        out["wrapper/broadcast"] = (digest(z), torch.equal(z, torch.full((3,), float(world - 1))))
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_collectives_match_torch_on_every_rank(world):
    names = [unique_name() for _ in range(2 * len(RUNNABLE) + 1)]
    got, codes = run_ranks(world, _collectives, names, RUNNABLE, timeout=120)
    assert sorted(got) == list(range(world)), (got, codes)
    for rank, (status, value) in got.items():
        assert status == "ok", f"rank {rank}: {value}"
    cases = got[0][1]
    assert len(cases) > 40 * len(RUNNABLE)  # 43 per variant (each comm x dtype x size, gathers, broadcasts) + 5
    wrong = [key for r in range(world) for key, (_, ok) in got[r][1].items() if not ok]
    assert not wrong, f"differ from torch: {wrong[:10]}"
    # Bit-identical on every rank.
    for key, (h, _) in cases.items():
        assert all(got[r][1][key][0] == h for r in range(world)), key
    assert codes == [0] * world
    assert not [n for n in names if os.path.exists(shm_path(n))]


def _mismatch(rank: int, world: int, name: str) -> list[str]:
    comm = ShmCommunicator(name, rank, world, timeout_s=10)
    errors = []
    try:
        comm.all_reduce_(torch.zeros(4 + rank))  # 4 elements on rank 0, 5 on rank 1
    except RuntimeError as exc:
        errors.append(str(exc))
    try:
        comm.barrier()
    except RuntimeError as exc:
        errors.append(str(exc))
    return errors


def test_mismatched_calls_are_an_error_not_garbage():
    name = unique_name()
    got, _ = run_ranks(2, _mismatch, name, timeout=60)
    for rank in range(2):
        status, errors = got[rank]
        assert status == "ok", errors
        assert len(errors) == 2, errors
        assert "different collectives" in errors[0] and "rank 1: all-reduce of 5 float32 elements" in errors[0]
        assert "unusable after an earlier failure" in errors[1]
    assert not os.path.exists(shm_path(name))


# --- failures: a dead or missing peer never hangs anyone -------------------------------------------------


def _killed_mid_step(rank: int, world: int, name: str) -> tuple[str, float]:
    torch.set_num_threads(1)
    comm = ShmCommunicator(name, rank, world, timeout_s=30)  # detection must come from the pid, not the timeout
    for step in range(20):
        if rank == 1 and step == 5:
            os.kill(os.getpid(), signal.SIGKILL)
        t = torch.ones(4096, dtype=torch.bfloat16)
        start = time.monotonic()
        try:
            comm.all_reduce_(t)
        except RuntimeError as exc:
            elapsed = time.monotonic() - start
            try:
                comm.all_reduce_(t)
                again = "no error"
            except RuntimeError as exc2:
                again = str(exc2)
            return f"{exc} | {again}", elapsed
        assert torch.equal(t, torch.full_like(t, world))
    return "no error", 0.0


def test_a_killed_rank_makes_the_others_raise_within_seconds():
    name = unique_name()
    got, codes = run_ranks(3, _killed_mid_step, name, timeout=60)
    assert codes[1] == -signal.SIGKILL
    assert sorted(got) == [0, 2], got
    for rank in (0, 2):
        status, (message, elapsed) = got[rank]
        assert status == "ok", message
        assert "tensor-parallel rank 1 (pid" in message and "exited" in message, message
        assert "unusable after an earlier failure" in message, message  # poisoned: the second call fails at once
        assert elapsed < 5.0, (message, elapsed)
    assert not os.path.exists(shm_path(name))


def _never_arrives(rank: int, world: int, name: str) -> tuple[str, float]:
    comm = ShmCommunicator(name, rank, world, timeout_s=1.5)
    if rank == 1:
        time.sleep(3.5)  # attached and alive, but never calls
        return "slept", 0.0
    start = time.monotonic()
    try:
        comm.all_reduce_(torch.ones(16))
    except RuntimeError as exc:
        return str(exc), time.monotonic() - start
    return "no error", 0.0


def test_a_peer_that_never_arrives_times_out():
    name = unique_name()
    got, _ = run_ranks(2, _never_arrives, name, timeout=10)
    status, (message, elapsed) = got[0]
    assert status == "ok", message
    assert "tensor-parallel rank 1 (pid" in message and "did not reach the all-reduce within 1.5 s" in message
    assert 1.5 <= elapsed < 5.0, elapsed
    assert not os.path.exists(shm_path(name))


def _closes_early(rank: int, world: int, name: str) -> str:
    comm = ShmCommunicator(name, rank, world, timeout_s=20)
    if rank == 1:
        comm.close()
        time.sleep(2)  # alive, but gone from the group
        return "closed"
    try:
        comm.barrier()
    except RuntimeError as exc:
        return str(exc)
    return "no error"


def test_a_peer_that_closed_is_an_error():
    name = unique_name()
    got, _ = run_ranks(2, _closes_early, name, timeout=30)
    assert "tensor-parallel rank 1 (pid" in got[0][1] and "closed the communicator" in got[0][1], got


def test_a_missing_peer_at_startup_times_out_and_leaves_nothing():
    name = unique_name()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"tensor-parallel rank 1 did not attach .* within 0.5 s"):
        ShmCommunicator(name, 0, 2, timeout_s=0.5)
    assert time.monotonic() - start < 3
    assert not os.path.exists(shm_path(name))
    with pytest.raises(RuntimeError, match="rank 0 did not create the shared-memory segment"):
        ShmCommunicator(unique_name(), 1, 2, timeout_s=0.3)
    # labels (a pipeline link's global ranks) name the members instead
    with pytest.raises(RuntimeError, match=r"^rank 3 \(pp stage 1\) did not attach .* within 0.3 s"):
        ShmCommunicator(unique_name(), 0, 2, timeout_s=0.3, labels=("rank 1 (pp stage 0)", "rank 3 (pp stage 1)"))


def test_a_rank_with_other_sizes_is_refused():
    """Ranks given different world sizes or buffers: the late one raises, naming both (threads: the constructor
    releases the GIL)."""
    name = unique_name()
    errors = []

    def rank0():
        try:
            ShmCommunicator(name, 0, 2, buffer_bytes=8192, timeout_s=2)
        except RuntimeError as exc:
            errors.append(str(exc))

    first = threading.Thread(target=rank0)
    first.start()
    with pytest.raises(RuntimeError, match="created for 2 ranks with buffer_bytes 8192, but rank 2 was given 3 ranks"):
        ShmCommunicator(name, 2, 3, buffer_bytes=8192, timeout_s=2)
    first.join(timeout=10)
    assert errors and "did not attach" in errors[0], errors
    assert not os.path.exists(shm_path(name))


# --- one process: arguments and the binding's checks -----------------------------------------------------


def test_single_rank_and_argument_checks():
    name = unique_name()
    comm = cpuinfer._C.ShmComm(name, 0, 1)
    assert not os.path.exists(shm_path(name))  # unlinked once every rank (just this one) attached
    assert (comm.rank, comm.world_size, comm.buffer_bytes, comm.name) == (0, 1, 16 << 20, "/" + name)
    t = torch.randn(10, dtype=torch.bfloat16)
    before = t.clone()
    comm.all_reduce_(t)
    assert torch.equal(t, before)
    out = torch.empty(1, 10, dtype=torch.bfloat16)
    comm.all_gather(t, out)
    assert torch.equal(out[0], t)
    with pytest.raises(ValueError, match="contiguous"):
        comm.all_reduce_(torch.randn(4, 4).t())
    with pytest.raises(TypeError, match="int64"):
        comm.all_reduce_(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(ValueError, match="world_size x inp's elements"):
        comm.all_gather(t, torch.empty(11, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="dtype"):
        comm.all_gather(t, torch.empty(10))
    with pytest.raises(ValueError, match="overlap"):
        base = torch.zeros(20)
        comm.all_gather(base[5:15], base[:10])
    with pytest.raises(ValueError, match="root"):
        comm.broadcast_(t, 1)
    comm.close()
    comm.close()
    assert comm.closed
    with pytest.raises(RuntimeError, match="closed"):
        comm.barrier()
    for args, match in [
        ((name, 2, 2), "rank must be in"),
        ((name, 0, 0), "world_size must be in"),
        ((name, 0, 1, 16), "buffer_bytes must be in"),
        ((name, 0, 1, -1), "buffer_bytes must be positive"),
        ((name, 0, 1, 4096, 0.0), "timeout_s"),
        (("a/b", 0, 1), "without '/'"),
        ((name, 0, 2, 4096, 1.0, [], ["only one"]), "labels must name all 2 ranks, got 1"),
    ]:
        with pytest.raises(ValueError, match=match):
            cpuinfer._C.ShmComm(*args)


def test_a_watched_process_that_exits_before_attaching_ends_the_wait():
    """Rank 0 waiting for a peer that will never attach (a worker that died while starting) with that worker's
    pid in `watch`: RuntimeError naming the pid within a second of its exit, not after timeout_s; and nothing
    left in /dev/shm."""
    name = unique_name()
    worker = mp.get_context("spawn").Process(target=time.sleep, args=(0.5,))
    worker.start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=rf"process {worker.pid}, which this group waits on, exited while the ranks"):
        ShmCommunicator(name, 0, 2, timeout_s=60, watch=(worker.pid,))
    assert time.monotonic() - start < 5
    worker.join()
    assert not os.path.exists(shm_path(name))
