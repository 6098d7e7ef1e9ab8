"""The pieces of data parallelism that need no server: the routing rule, merged stats, refused arguments."""

from __future__ import annotations

import importlib.util

import pytest

from cpuinfer.config import EngineArgs
from cpuinfer.engine.messages import EngineStats, merge_stats
from cpuinfer.entrypoints.openai.dp_router import NoLiveCoreError, PrefixAwareRouter

BS = 16


def prompt(prefix: int, length: int = 3 * BS) -> list[int]:
    """A prompt whose first two blocks depend on `prefix` only."""
    return [prefix * 1000 + i for i in range(2 * BS)] + list(range(length - 2 * BS))


def test_no_shared_prefix_is_least_loaded_ties_by_rank():
    r = PrefixAwareRouter(3, BS, 100)
    assert r.choose([1, 2, 3], [0, 0, 0]) == 0
    assert r.choose([1, 2, 3], [1, 0, 0]) == 1
    assert r.choose([1, 2, 3], [5, 4, 1]) == 2
    assert r.choose(list(range(100)), [3, 3, 3]) == 0  # full blocks, but no core saw them


def test_a_prefix_follows_its_core_within_the_slack():
    r = PrefixAwareRouter(2, BS, 100)
    assert r.choose(prompt(7), [0, 0]) == 0
    assert r.choose(prompt(7), [2, 0]) == 0  # 2 above the least loaded: within the slack
    assert r.choose(prompt(7), [3, 0]) == 1  # beyond it: least loaded wins (and now core 1 holds it too)
    assert r.choose(prompt(8), [0, 0]) == 0  # another prefix, nobody saw it
    assert r.choose(prompt(7), [1, 0]) == 1  # both saw prefix 7: the less loaded one
    # The slack grows with the load: 25% of the least loaded core's sequences.
    assert r.choose(prompt(8), [50, 40]) == 0


def test_the_longest_seen_prefix_wins():
    r = PrefixAwareRouter(2, BS, 100)
    shared = list(range(2 * BS))
    assert r.choose(shared + [1] * BS, [0, 0]) == 0
    assert r.choose(shared + [2] * BS, [5, 0]) == 1  # core 0 is too busy: core 1 sees the shared blocks
    # Both saw the shared blocks; only core 1 saw the third block [2]*BS.
    assert r.choose(shared + [2] * BS + [9] * BS, [0, 1]) == 1
    assert r.choose(shared + [1] * BS, [1, 0]) == 0


def test_dead_cores_are_skipped_and_memory_is_bounded():
    r = PrefixAwareRouter(2, BS, capacity=4)
    assert r.choose(prompt(1), [None, 3]) == 1
    with pytest.raises(NoLiveCoreError):
        r.choose(prompt(1), [None, None])
    for i in range(10):
        r.choose(prompt(100 + i), [0, None])
    assert len(r.seen[0]) == 4


def test_merged_stats_add_up_and_keep_dead_counters():
    a = EngineStats(
        num_running=2,
        num_kv_blocks=100,
        num_free_kv_blocks=50,
        kv_cache_usage=0.5,
        prefix_cache_queries=100,
        prefix_cache_hits=50,
        prompt_tokens=10,
        generation_tokens=20,
    )
    b = EngineStats(num_waiting=1, num_kv_blocks=300, num_free_kv_blocks=300, prefix_cache_queries=100)
    gone = EngineStats(prompt_tokens=5, generation_tokens=7, prefix_cache_queries=200, prefix_cache_hits=150)
    m = merge_stats([a, b], [gone])
    assert (m.num_running, m.num_waiting, m.num_kv_blocks, m.num_free_kv_blocks) == (2, 1, 400, 350)
    assert m.kv_cache_usage == pytest.approx(50 / 400)
    assert (m.prompt_tokens, m.generation_tokens) == (15, 27)
    assert m.prefix_cache_hit_rate == pytest.approx(200 / 400)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(data_parallel_size=0), "--data-parallel-size=0 must be a positive integer"),
        (dict(data_parallel_size=2, data_parallel_rank=2), r"--data-parallel-rank=2 must be in 0\.\.1"),
        (dict(data_parallel_rank_local=1), "give both"),
    ],
)
def test_bad_data_parallel_args(kw, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**kw).create_engine_config()


def test_ray_backend_without_ray_names_the_extra(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install 'cpuinfer\[ray\]'"):
        EngineArgs(data_parallel_backend="ray").create_engine_config()


def test_offline_data_parallel_needs_a_rank_per_process():
    from cpuinfer import LLM

    with pytest.raises(ValueError, match="one engine per process"):
        LLM(data_parallel_size=2)
    with pytest.raises(ValueError, match="Ray data parallelism is for `cpuinfer serve`"):
        LLM(data_parallel_backend="ray")
