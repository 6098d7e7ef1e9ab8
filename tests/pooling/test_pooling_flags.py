"""vLLM's pooling flags resolve into one EngineConfig: --runner, --task embed, --convert embed, --pooler-config."""

from __future__ import annotations

import argparse

import pytest

from cpuinfer.config import EngineArgs

from .tiny_embedders import make_qwen3, write_sentence_transformers


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = make_qwen3(tmp_path_factory.mktemp("flags"))
    write_sentence_transformers(path, "mean", False)
    return str(path)


def config(model: str, *flags: str):
    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(["--model", model, *flags])).create_engine_config(serving=True)


@pytest.mark.parametrize("flags", [["--runner", "pooling"], ["--task", "embed"], ["--convert", "embed"]])
def test_each_spelling_selects_the_pooling_runner(model, flags, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.05")
    cfg = config(model, *flags)
    assert cfg.runner == "pooling"
    assert (cfg.pooler.pooling_type, cfg.pooler.normalize) == ("MEAN", False)  # modules.json's


def test_pooler_config_overrides_the_checkpoint_and_generate_stays_default(model, monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.05")
    cfg = config(model, "--runner", "pooling", "--pooler-config", '{"pooling_type": "last", "normalize": true}')
    assert (cfg.pooler.pooling_type, cfg.pooler.normalize) == ("LAST", True)
    assert config(model).runner == "generate"
    with pytest.raises(ValueError, match="--pooler-config needs the pooling runner"):
        config(model, "--pooler-config", "{}")
    with pytest.raises(ValueError, match="--pooler-config is not valid JSON"):
        config(model, "--runner", "pooling", "--pooler-config", "{last}")
    with pytest.raises(ValueError, match="--pooler-config must be a JSON object, got list"):  # was a TypeError
        config(model, "--runner", "pooling", "--pooler-config", '["last"]')
    with pytest.raises(ValueError, match="--hf-overrides must be a JSON object, got int"):
        config(model, "--runner", "pooling", "--hf-overrides", "3")
    with pytest.raises(ValueError, match="unsupported field"):
        config(model, "--runner", "pooling", "--pooler-config", '{"softmax": true}')
    with pytest.raises(ValueError, match="one rank"):
        config(model, "--runner", "pooling", "-tp", "2")
    with pytest.raises(ValueError, match="cannot speculate"):
        config(model, "--runner", "pooling", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}')
    assert config(model, "--task", "score").runner == "pooling"  # vLLM's --task score: the pooling runner
    with pytest.raises(SystemExit):
        config(model, "--task", "transcription")
