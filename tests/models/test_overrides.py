"""--tokenizer, --generation-config and the remote-code note on a loaded spec (model_loader.overrides)."""

import dataclasses
import json
import logging

import pytest

from cpuinfer.config import default_model_path
from cpuinfer.errors import ModelLoadError
from cpuinfer.model_loader import load_model_spec
from cpuinfer.model_loader.overrides import note_remote_code, with_generation_config, with_tokenizer


@pytest.fixture(scope="module")
def spec():
    return dataclasses.replace(load_model_spec(default_model_path()), generation_defaults={"temperature": 0.2})


def test_generation_config_auto_vllm_and_a_directory(spec, tmp_path):
    assert with_generation_config(spec, "auto").generation_defaults == {"temperature": 0.2}
    assert with_generation_config(spec, "vllm").generation_defaults == {}
    (tmp_path / "generation_config.json").write_text(json.dumps({"top_k": 5, "eos_token_id": 2}))
    assert with_generation_config(spec, str(tmp_path)).generation_defaults == {"top_k": 5}
    with pytest.raises(ModelLoadError, match="--generation-config"):
        with_generation_config(spec, str(tmp_path / "absent"))


def test_a_tokenizer_directory_replaces_the_tokenizer_and_template(spec, tmp_path):
    spec.tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "T {{ messages }}"}))
    out = with_tokenizer(spec, str(tmp_path))
    assert out.chat_template == "T {{ messages }}"
    assert out.tokenizer.encode("Hello").ids == spec.tokenizer.encode("Hello").ids
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match=r"has no tokenizer\.json"):
        with_tokenizer(spec, str(tmp_path / "empty"))
    small = dataclasses.replace(spec, vocab_size=100)
    with pytest.raises(ModelLoadError, match="belongs to another model"):
        with_tokenizer(small, str(tmp_path))


def test_a_model_asking_for_remote_code_is_told_it_never_runs(spec, caplog):
    with caplog.at_level(logging.WARNING, logger="cpuinfer.model_loader"):
        note_remote_code(spec)
        assert not caplog.records
        note_remote_code(dataclasses.replace(spec, hf_config={**spec.hf_config, "auto_map": {"AutoModel": "x.Y"}}))
    assert "never runs code from a model repository" in caplog.text
