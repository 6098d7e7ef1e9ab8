"""Tensor parallelism (-tp 2) against one rank, on the tiny checkpoints of every architecture.

Each run is a fresh process (tests/engine/tp_runs.py): rank 0 of a tensor-parallel engine binds the
process it runs in. Two ranks are pinned to the machine's two first CPUs (or share one CPU).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.models.test_tiny_models import _checkpoint

pytest.importorskip("transformers")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _env(tp: int) -> dict:
    """One CPU per rank (the first two this process may use; both ranks on one CPU if it has only one)."""
    cpus = sorted(os.sched_getaffinity(0))
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cpus[r % len(cpus)]) for r in range(tp))
    env.pop("CPUINFER_OMP_THREADS_BIND", None)
    return env


def run(*args: str, timeout: float = 240) -> dict:
    """tp_runs.py's JSON line; the last argument is the tensor-parallel size."""
    env = _env(int(args[-1]))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.engine.tp_runs", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return {name: str(_checkpoint(tmp_path_factory, name)[0]) for name in ("llama", "qwen2", "gemma3", "opt")}


# llama: 2 heads, 1 KV head (replicated on both ranks), tied embedding; qwen2: 4 heads, 2 KV heads (split),
# q/k/v biases, head size 32 (torch attention); gemma3: sandwich norms, soft-capped logits; opt: LayerNorm,
# fc1/fc2 with biases, learned positions.
@pytest.mark.parametrize("name", ["llama", "qwen2", "gemma3", "opt"])
def test_float32_tp2_gives_tp1_tokens(checkpoints, name):
    """float32: token for token, with chunked prefill mixed with decodes (greedy()'s batched mode)."""
    one = run("runner", checkpoints[name], "float32", "1")
    two = run("runner", checkpoints[name], "float32", "2")
    assert two["tokens"] == one["tokens"]
    torch.testing.assert_close(torch.tensor(two["first"]), torch.tensor(one["first"]), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_bfloat16_tp2_stays_close_to_tp1(checkpoints, name):
    """bf16 (the fused decoder layer, with its all-reduces in the kernel): first-token logits within the bf16
    tolerance the other model tests use, and the fused path taken."""
    one = run("runner", checkpoints[name], "bfloat16", "1")
    two = run("runner", checkpoints[name], "bfloat16", "2")
    assert all(two["fused"]) and all(one["fused"])
    for a, b in zip(two["first"], one["first"], strict=True):
        a, b = torch.tensor(a), torch.tensor(b)
        assert (a - b).abs().max() <= 0.05 * b.abs().max()


@pytest.mark.parametrize("kv", ["auto", "fp8_e5m2"])
def test_engine_features_under_tp2(checkpoints, kv):
    """The whole engine with prefix caching, chunked prefill and preemption (and an fp8 KV cache): the same
    greedy tokens as one rank, and the features were exercised."""
    one = run("engine", checkpoints["llama"], "float32", kv, "1")
    two = run("engine", checkpoints["llama"], "float32", kv, "2")
    assert two["tokens"] == one["tokens"]
    assert two["preemptions"] > 0 and two["prefix_hits"] > 0
