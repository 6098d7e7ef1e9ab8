"""EngineArgs resolution: vLLM flag names, defaults, and clear errors before anything is loaded."""

from __future__ import annotations

import argparse

import pytest

from cpuinfer.cli.main import main
from cpuinfer.config import EngineArgs
from cpuinfer.envs import EnvError


def parse(*argv):
    return EngineArgs.from_cli_args(EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(list(argv)))


def test_cli_flags_like_vllm():
    a = parse(
        "--dtype",
        "bfloat16",
        "--max-model-len",
        "512",
        "--block-size",
        "32",
        "--kv-cache-dtype",
        "fp8_e5m2",
        "--max-num-seqs",
        "4",
        "--max-num-batched-tokens",
        "64",
        "--no-enable-prefix-caching",
        "--seed",
        "3",
        "-tp",
        "1",
    )
    assert (
        a.dtype,
        a.max_model_len,
        a.block_size,
        a.kv_cache_dtype,
        a.max_num_seqs,
        a.max_num_batched_tokens,
        a.enable_prefix_caching,
        a.seed,
        a.tensor_parallel_size,
    ) == ("bfloat16", 512, 32, "fp8_e5m2", 4, 64, False, 3, 1)
    assert parse().enable_prefix_caching is True and parse().block_size == 128


def test_defaults_by_use(smol_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.25")
    offline = EngineArgs(model=smol_path).create_engine_config()
    serving = EngineArgs(model=smol_path).create_engine_config(serving=True)
    assert (offline.max_num_batched_tokens, offline.max_num_seqs) == (4096, 256)
    assert (serving.max_num_batched_tokens, serving.max_num_seqs) == (2048, 128)
    assert offline.max_model_len == offline.spec.max_model_len
    per_token = offline.spec.kv_bytes_per_token(offline.cache_dtype)
    assert offline.num_blocks == int(0.25 * 2**30) // (per_token * 128)
    fp8 = EngineArgs(model=smol_path, kv_cache_dtype="fp8_e5m2").create_engine_config()
    assert fp8.num_blocks == 2 * offline.num_blocks or fp8.num_blocks == 2 * offline.num_blocks + 1
    # VLLM_CPU_KVCACHE_SPACE is per rank: a stage of a pipeline holds its layers only (30 = 15 + 15; 30 over 4
    # stages = 7, 8, 8, 7 layers: the largest stage sizes every rank's pool).
    for pp, layers in ((2, 15), (4, 8)):
        staged = EngineArgs(model=smol_path, pipeline_parallel_size=pp).create_engine_config()
        assert staged.kv_bytes_per_token == per_token // 30 * layers
        assert staged.num_blocks == int(0.25 * 2**30) // (staged.kv_bytes_per_token * 128)


@pytest.mark.parametrize(
    "kw, match",
    [
        (dict(tensor_parallel_size=2), "tensor-parallel-size=2 cannot split .*9 attention heads"),
        (dict(tensor_parallel_size=0), "tensor-parallel-size=0 must be a positive integer"),
        (dict(pipeline_parallel_size=31), "pipeline-parallel-size=31 exceeds the model's 30 layers"),
        (dict(data_parallel_backend="mpi"), "data-parallel-backend='mpi' is not one of mp, ray"),
        (dict(data_parallel_size=2, data_parallel_rank=2), r"data-parallel-rank=2 must be in 0\.\.1"),
        (dict(block_size=20), "block-size=20.*multiple of 16"),
        (dict(max_num_seqs=0), "max-num-seqs=0"),
        (dict(max_model_len=10**6), "max-model-len=1000000 exceeds.*8192"),
        (dict(kv_cache_dtype="fp8_e4m3"), "kv-cache-dtype='fp8_e4m3'"),
        (dict(model="/nonexistent/model.gguf"), "no such file"),
    ],
)
def test_bad_args(smol_path, kw, match):
    with pytest.raises(ValueError, match=match):
        EngineArgs(**{"model": smol_path, **kw}).create_engine_config()


def test_max_model_len_must_fit_kv(smol_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.01")
    with pytest.raises(ValueError, match=r"max_model_len=8192.*VLLM_CPU_KVCACHE_SPACE=0.01 GiB holds \d+ tokens"):
        EngineArgs(model=smol_path).create_engine_config()
    assert EngineArgs(model=smol_path, max_model_len=256).create_engine_config().max_model_len == 256


@pytest.mark.parametrize("value", ["abc", "-1", "0"])
def test_malformed_kv_space(smol_path, monkeypatch, value):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", value)
    with pytest.raises(EnvError, match="VLLM_CPU_KVCACHE_SPACE"):
        EngineArgs(model=smol_path).create_engine_config()


def test_cli_bad_flag_is_one_clear_line(smol_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", "hi", "--model", smol_path, "-tp", "2"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--tensor-parallel-size=2 cannot split" in err and "9 attention heads are not divisible by 2" in err


@pytest.mark.parametrize(
    ("kw", "local_core", "local_cores"),
    [
        ({}, 0, 1),
        # mp backend: every data-parallel core is on this machine, in rank order
        ({"data_parallel_size": 3, "data_parallel_rank": 2}, 2, 3),
        # Ray: one core per node unless its placement said where the core sits among its machine's
        ({"data_parallel_size": 4, "data_parallel_rank": 3, "data_parallel_backend": "ray"}, 3, 1),
        (
            {
                "data_parallel_size": 4,
                "data_parallel_rank": 3,
                "data_parallel_backend": "ray",
                "data_parallel_rank_local": 1,
                "data_parallel_size_local": 2,
            },
            1,
            2,
        ),
    ],
)
def test_parallel_placement_is_resolved_from_the_flags(kw, local_core, local_cores):
    from cpuinfer.config import ParallelConfig

    par = ParallelConfig.from_args(EngineArgs(tensor_parallel_size=2, pipeline_parallel_size=3, **kw))
    assert (par.world_size, par.local_core, par.local_cores) == (6, local_core, local_cores)
    assert par.machine_ranks == 6 * local_cores
    assert [par.global_rank(r) for r in (0, 5)] == [6 * local_core, 6 * local_core + 5]


def test_a_data_parallel_core_gets_the_resolved_config_with_its_rank(smol_path, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.05")
    config = EngineArgs(model=smol_path, max_model_len=256, data_parallel_size=2).create_engine_config()
    one = config.for_data_parallel_rank(1)
    assert one.args.data_parallel_rank == 1 and config.args.data_parallel_rank == 0
    assert (one.spec, one.num_blocks, one.parallel.local_core) == (config.spec, config.num_blocks, 1)
    placed = config.for_data_parallel_rank(1, 0, 1)
    assert (placed.parallel.local_core, placed.parallel.local_cores) == (0, 1)
