"""Engine test fixtures: the demo model's spec and one loaded runner, shared by the whole session."""

from __future__ import annotations

import copy

import pytest
import torch

from cpuinfer.config import default_model_path

BLOCK = 16
NUM_BLOCKS = 256  # 4096 tokens: small, like VLLM_CPU_KVCACHE_SPACE=0.1


@pytest.fixture(scope="session")
def smol_path():
    """Path of the bundled SmolLM2 GGUF (skip when the demo package is absent)."""
    try:
        return default_model_path()
    except ValueError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def smol_spec(smol_path):
    """ModelSpec of SmolLM2 in bfloat16 (config + tokenizer, no weights)."""
    from cpuinfer.model_loader import load_model_spec

    return load_model_spec(smol_path, "bfloat16")


@pytest.fixture(scope="session")
def smol_tokenizer(smol_spec):
    """tokenizers.Tokenizer of the bundled SmolLM2 GGUF."""
    return smol_spec.tokenizer


@pytest.fixture(scope="session")
def smol_runner(smol_spec):
    """One loaded bf16 ModelRunner (block size 16); engines built on it differ only in scheduling and pool."""
    from cpuinfer.worker.model_runner import ModelRunner

    return ModelRunner(smol_spec, BLOCK, NUM_BLOCKS, torch.bfloat16)


@pytest.fixture(scope="session")
def smol_runner_fp8(smol_runner):
    """The same weights with an fp8_e5m2 KV cache (a shallow copy: only the cache differs)."""
    r = copy.copy(smol_runner)
    shape = smol_runner.kv_caches[0][0].shape
    r.cache_dtype = torch.float8_e5m2
    r.kv_caches = [
        (torch.zeros(shape, dtype=torch.float8_e5m2), torch.zeros(shape, dtype=torch.float8_e5m2))
        for _ in smol_runner.kv_caches
    ]
    return r
