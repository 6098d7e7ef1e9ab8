"""Pipeline parallelism (-pp 2, -pp 3, -tp 2 -pp 2) against one rank, on 4-layer tiny checkpoints.

Each run is a fresh process (tests/engine/tp_runs.py), as for tensor parallelism; ranks get one CPU each
(the machine's first two, shared when there are more ranks than CPUs).
"""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_tensor_parallel import _env, kill_rank_0, kill_rank_mid_stream, run
from tests.models.test_tiny_models import CASES

transformers = pytest.importorskip("transformers")
# The tests' steps are small (a few tokens per sequence): split them anyway, so micro-batches are exercised.
SPLIT = {"CPUINFER_PP_MICRO_BATCHES": "3"}


def _deep_checkpoint(tmp_path_factory, name: str, layers: int = 4) -> str:
    """test_tiny_models' checkpoint of `name` with `layers` layers (two per stage at -pp 2)."""
    cls_name, kwargs = CASES[name]
    kwargs = dict(kwargs, num_hidden_layers=layers)
    if "layer_types" in kwargs:
        kwargs["layer_types"] = (kwargs["layer_types"] * layers)[:layers]
    config = getattr(transformers, cls_name)(**kwargs)
    torch.manual_seed(1234)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    path = tmp_path_factory.mktemp(f"{name}{layers}")
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: _deep_checkpoint(tmp_path_factory, name) for name in ("llama", "gemma3", "opt")}


def test_stage_split_and_micro_batches():
    """vLLM's layer split (the remainder to the stages before the last) and the micro-batch split."""
    from cpuinfer.distributed.pipeline import micro_batches, stage_layers

    assert [stage_layers(30, 4, s) for s in range(4)] == [(0, 7), (7, 15), (15, 23), (23, 30)]
    assert [stage_layers(5, 2, s) for s in range(2)] == [(0, 3), (3, 5)]
    assert [stage_layers(4, 3, s) for s in range(3)] == [(0, 1), (1, 3), (3, 4)]
    assert micro_batches([200], 2) == [(0, 1)]  # one sequence: one micro-batch
    assert micro_batches([1] * 16, 2) == [(0, 16)]  # a decode step: not split (memory-bound)
    assert micro_batches([1] * 16, 2, min_tokens=1) == [(0, 8), (8, 16)]
    assert micro_batches([128, 128], 4) == [(0, 1), (1, 2)]
    assert micro_batches([100, 1, 1, 1, 90, 1], 2) == [(0, 1), (1, 6)]  # near-equal tokens
    assert micro_batches([7, 1, 1], 3, min_tokens=1) == [(0, 1), (1, 2), (2, 3)]
    assert micro_batches([1, 1, 7], 3, min_tokens=1) == [(0, 1), (1, 2), (2, 3)]


# llama: tied embedding (on both the first and the last stage); gemma3: scaled embedding, sandwich norms,
# soft-capped logits; opt: no residual stream (h alone crosses), learned positions on the first stage only.
@pytest.mark.parametrize("name", ["llama", "gemma3", "opt"])
def test_float32_pp2_gives_pp1_tokens(checkpoints, name):
    """float32: token for token with chunked prefill mixed with decodes (steps of 2 and 3 sequences run as
    micro-batches), each stage holding two of the four layers."""
    one = run("runner", checkpoints[name], "float32", "1")
    two = run("runner", checkpoints[name], "float32", "1x2", env=SPLIT)
    assert two["tokens"] == one["tokens"]
    assert len(two["fused"]) == 2  # rank 0 built its two layers only
    torch.testing.assert_close(torch.tensor(two["first"]), torch.tensor(one["first"]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("size", ["1x3", "2x2"])
def test_float32_three_stages_and_tp2_pp2(checkpoints, size):
    """Three stages (1, 2, 1 layers: a middle stage with neither embedding nor head), and TP=2 x PP=2 (four
    ranks): the same tokens as one rank."""
    one = run("runner", checkpoints["llama"], "float32", "1")
    many = run("runner", checkpoints["llama"], "float32", size, timeout=400, env=SPLIT)
    assert many["tokens"] == one["tokens"]
    torch.testing.assert_close(torch.tensor(many["first"]), torch.tensor(one["first"]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_bfloat16_pp2_fused_layers(checkpoints, name):
    """bf16 runs the fused decoder layer on both stages (the second stage's first layer continues the residual
    stream it received): one stage's tokens and first-token logits, bit for bit (a stage boundary changes no
    arithmetic, and every kernel gives a row the same bits in any micro-batch)."""
    one = run("runner", checkpoints[name], "bfloat16", "1")
    two = run("runner", checkpoints[name], "bfloat16", "1x2", env=SPLIT)
    assert all(two["fused"]) and all(one["fused"])
    assert two["tokens"] == one["tokens"]
    assert torch.equal(torch.tensor(two["first"]), torch.tensor(one["first"]))


@pytest.mark.parametrize("kv", ["auto", "fp8_e5m2"])
def test_engine_features_under_pp2(checkpoints, kv):
    """The whole engine (prefix caching, chunked prefill, preemption, an fp8 KV cache) over two stages."""
    one = run("engine", checkpoints["llama"], "float32", kv, "1")
    two = run("engine", checkpoints["llama"], "float32", kv, "1x2", env=SPLIT)
    assert two["tokens"] == one["tokens"]
    assert two["preemptions"] > 0 and two["prefix_hits"] > 0


def test_too_many_stages_are_refused(checkpoints):
    from cpuinfer.config import EngineArgs

    with pytest.raises(ValueError, match=r"--pipeline-parallel-size=5 exceeds the model's 4 layers"):
        EngineArgs(model=checkpoints["llama"], pipeline_parallel_size=5).create_engine_config()


@pytest.fixture
def pp_engine(checkpoints, monkeypatch):
    for k, v in _env(2).items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.01")
    from cpuinfer.config import EngineArgs
    from cpuinfer.engine.async_llm import AsyncLLM

    args = EngineArgs(model=checkpoints["llama"], pipeline_parallel_size=2, block_size=16)
    engine = AsyncLLM.from_engine_args(args)
    yield engine
    engine.shutdown()


def test_the_last_stage_killed_mid_step_fails_the_engine_fast(pp_engine):
    """SIGKILL rank 1 (the last stage) while a request streams: the stream fails with EngineDeadError naming
    it within seconds (rank 0 waits on it for the logits and sees its pid gone), and the core exits."""
    layout = pp_engine.layout
    assert [(p.rank, p.stage) for p in layout] == [(0, 0), (1, 1)]
    assert "pp stage 1" in layout[1].describe()
    kill_rank_mid_stream(pp_engine, 1)


def test_the_first_stage_killed_stops_the_last(pp_engine):
    """SIGKILL the engine core (rank 0, the first stage): the last stage exits within seconds."""
    kill_rank_0(pp_engine, 1)


def test_a_stage_killed_while_starting_fails_the_start_fast(checkpoints, monkeypatch):
    """SIGKILL rank 1 before it attaches to the communicators: building the executor fails within seconds,
    naming the rank, instead of rank 0 waiting out the stage link's timeout (10 minutes)."""
    import multiprocessing as mp
    import os
    import signal
    import threading
    import time

    for k, v in _env(2).items():
        monkeypatch.setenv(k, v)
    from cpuinfer.config import EngineArgs
    from cpuinfer.worker.tp_executor import RankExecutor

    config = EngineArgs(model=checkpoints["llama"], pipeline_parallel_size=2, block_size=16).create_engine_config()
    outcome = {}

    def build():
        try:
            RankExecutor(config).shutdown()
            outcome["error"] = None
        except Exception as exc:  # noqa: BLE001 - the test checks which exception the start raised
            outcome["error"] = exc

    before = {p.pid for p in mp.active_children()}
    thread = threading.Thread(target=build, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not (children := [p for p in mp.active_children() if p.pid not in before]):
        assert time.monotonic() < deadline, "rank 1 was never started"
        time.sleep(0.005)
    os.kill(children[0].pid, signal.SIGKILL)
    killed = time.monotonic()
    thread.join(timeout=30)
    assert not thread.is_alive(), "the executor still waits for the killed rank"
    assert time.monotonic() - killed < 15
    assert isinstance(outcome["error"], RuntimeError), outcome
    assert "rank 1" in str(outcome["error"]) and "while starting" in str(outcome["error"]), outcome["error"]
