"""Scheduler + block pool + prefix cache through the engine core, on a fake model whose output depends on the
exact tokens it reads back from its cache (tests/engine/fake_runner.py)."""

from __future__ import annotations

import random

import pytest

from cpuinfer.engine.block_pool import BlockPool, NoFreeBlocks, block_hash
from cpuinfer.engine.core import EngineCore
from cpuinfer.engine.limits import RequestLimits
from cpuinfer.engine.messages import AddRequest
from cpuinfer.engine.scheduler import SchedulerConfig
from cpuinfer.sampling_params import SamplingParams

from .fake_runner import VOCAB, FakeRunner, reference_greedy


def make_core(num_blocks=64, block_size=16, batched=4096, seqs=256, max_len=512, caching=True, threshold=0, eos=()):
    runner = FakeRunner(num_blocks, block_size)
    core = EngineCore(
        runner,
        SchedulerConfig(batched, seqs, max_len, threshold),
        num_blocks,
        block_size,
        caching,
        list(eos),
        RequestLimits(max_model_len=max_len, vocab_size=VOCAB),
    )
    return core, runner


def run(core, prompts, max_tokens, params=None):
    out = {i: [] for i in range(len(prompts))}
    for i, p in enumerate(prompts):
        core.add_request(AddRequest(str(i), p, params or SamplingParams(temperature=0, max_tokens=max_tokens)))
    done = set()
    for _ in range(10000):
        if not core.has_unfinished():
            break
        for o in core.step():
            out[int(o.request_id)].extend(o.new_token_ids)
            if o.finish_reason:
                done.add(int(o.request_id))
    assert done == set(range(len(prompts)))
    return [out[i] for i in range(len(prompts))]


def prompts_(n, seed=0, shared=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(shared)]
    return [prefix + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 70))] for _ in range(n)]


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(batched=16),  # chunked prefill forced small
        dict(threshold=5),  # long-prefill threshold
        dict(caching=False),
        dict(num_blocks=12, max_len=160),  # tiny pool: preemption by recompute
        dict(num_blocks=12, max_len=160, batched=16, caching=False),
        dict(seqs=3),
    ],
)
def test_greedy_tokens_independent_of_batching(kw):
    ps = prompts_(32, shared=40)
    core, runner = make_core(**kw)
    got = run(core, ps, 20)
    for p, g in zip(ps, got, strict=False):
        assert g == reference_greedy(p, 20)
    if kw.get("num_blocks") == 12:
        assert core.stats().num_preemptions > 0
    assert core.pool.num_free == core.pool.num_blocks  # everything returned
    if "batched" in kw:
        assert max(sum(n for _, n, _ in step) for step in runner.steps) <= kw["batched"]


def test_decodes_not_stalled_by_long_prefill():
    core, runner = make_core(batched=32, max_len=600, num_blocks=64)
    core.add_request(AddRequest("a", [1, 2, 3], SamplingParams(temperature=0, max_tokens=30)))
    core.step()  # a is now decoding
    core.add_request(AddRequest("b", list(range(90)) * 4, SamplingParams(temperature=0, max_tokens=2)))
    steps_before = len(runner.steps)
    while core.requests.get("a") is not None:
        core.step()
    for step in runner.steps[steps_before:]:
        assert any(n == 1 and sample for _, n, sample in step), step  # a's decode is in every step
        assert sum(n for _, n, _ in step) <= 32


def test_prefix_cache_hits_and_verifies():
    core, _ = make_core(num_blocks=64)
    shared = list(range(50))  # 3 full blocks of 16
    run(core, [[*shared, 60, 61]], 3)
    s0 = core.stats()
    assert s0.prefix_cache_hits == 0
    got = run(core, [[*shared, 70]], 5)
    assert got[0] == reference_greedy([*shared, 70], 5)
    s = core.stats()
    assert s.prefix_cache_hits == 48
    assert s.prefix_cache_queries == 52 + 51
    assert s.prefix_cache_hit_rate == pytest.approx(48 / 103)


def test_last_token_always_computed_on_full_hit():
    core, runner = make_core()
    p = list(range(32))  # exactly two blocks
    run(core, [p], 2)
    runner.steps.clear()
    assert run(core, [p], 2)[0] == reference_greedy(p, 2)
    assert runner.steps[0] == [(16, 16, True)]  # block 0 hit, block 1 recomputed (last token needs logits)


def test_eos_stop_token_and_min_tokens():
    p = [5, 6, 7]
    ref = reference_greedy(p, 10)
    eos = ref[3]
    core, _ = make_core(eos=[eos])
    assert run(core, [p], 10)[0] == ref[: ref.index(eos) + 1]
    core, _ = make_core(eos=[eos])
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    assert run(core, [p], 10, params)[0] == ref
    core, _ = make_core()
    params = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=[ref[2]])
    assert run(core, [p], 10, params)[0] == ref[: ref.index(ref[2]) + 1]


def test_abort_frees_blocks():
    core, _ = make_core()
    core.add_request(AddRequest("x", list(range(40)), SamplingParams(max_tokens=50)))
    core.step()
    assert core.pool.num_free < core.pool.num_blocks
    core.abort(["x"])
    assert not core.has_unfinished()
    assert core.pool.num_free == core.pool.num_blocks


def test_request_limits_raise_before_work():
    core, runner = make_core(max_len=64)
    with pytest.raises(ValueError, match=r"maximum context length is 64 tokens.*65 input tokens"):
        core.add_request(AddRequest("a", [1] * 65, SamplingParams()))
    with pytest.raises(ValueError, match=r"'max_tokens' is too large: 20.*64"):
        core.add_request(AddRequest("b", [1] * 50, SamplingParams(max_tokens=20)))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        core.add_request(AddRequest("c", [VOCAB], SamplingParams()))
    assert not core.has_unfinished() and not runner.steps


# ---- block pool ---------------------------------------------------------------------------------------------
def test_pool_lru_eviction_and_refcounts():
    pool = BlockPool(4, 2)
    a = pool.allocate(2)
    h0 = block_hash(None, [1, 2])
    h1 = block_hash(h0, [3, 4])
    pool.cache_block(a[0], h0, None, [1, 2])
    pool.cache_block(a[1], h1, h0, [3, 4])
    pool.free(a[::-1])
    assert pool.num_free == 4
    # Uncached blocks are handed out before cached ones.
    b = pool.allocate(2)
    assert set(b).isdisjoint(a)
    assert pool.lookup([h0, h1], [1, 2, 3, 4]) == a
    pool.free(a[::-1])
    # Tail block (freed first) is evicted first.
    c = pool.allocate(1)
    assert c == [a[1]]
    assert pool.lookup([h0, h1], [1, 2, 3, 4]) == [a[0]]
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)


def test_pool_verifies_tokens_on_hit():
    pool = BlockPool(2, 2)
    a = pool.allocate(1)
    h = block_hash(None, [1, 2])
    pool.cache_block(a[0], h, None, [1, 2])
    assert pool.lookup([h], [1, 9]) == []  # same hash, other tokens: a miss
    assert pool.lookup([h], [1, 2]) == a
    assert pool.blocks[a[0]].ref_cnt == 2


def test_the_schedule_is_one_record_per_sequence_and_loads_no_model_code():
    """Each scheduled sequence is one typed record (its request with the runner's view: tokens, position, blocks,
    which rows it samples), in the runner's row order; and loading the scheduler loads neither the model runner
    nor the models (the record type is a leaf of the engine package)."""
    import subprocess
    import sys

    from cpuinfer.engine.block_pool import BlockPool
    from cpuinfer.engine.request import Request
    from cpuinfer.engine.scheduler import Scheduler

    sched = Scheduler(SchedulerConfig(20, 8, 512), BlockPool(64, 16, enable_caching=False))
    reqs = [Request(str(i), list(range(1, 1 + n)), SamplingParams(max_tokens=4), i, 4) for i, n in enumerate((12, 30))]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    (a, sa), (b, sb) = out.scheduled
    assert (a, b) == tuple(reqs)
    assert (sa.token_ids, sa.start_pos, sa.sample) == (list(range(1, 13)), 0, True)
    # The second prompt gets what is left of the 20-token budget: a chunk that does not sample yet.
    assert (sb.token_ids, sb.start_pos, sb.sample, sb.num_tokens) == (list(range(1, 9)), 0, False, 8)
    assert out.seqs == [sa, sb] and out.sampled == [a] and len(sa.block_table) == 1
    assert out.without({id(a)}).scheduled == [(b, sb)]

    code = (
        "import sys, cpuinfer.engine.scheduler; "
        "print(sorted(m for m in sys.modules if m.startswith(('cpuinfer.worker', 'cpuinfer.models'))))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]", loaded
