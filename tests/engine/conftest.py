"""Engine test fixtures: the demo model's tokenizer, loaded once."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def smol_tokenizer():
    """tokenizers.Tokenizer of the bundled SmolLM2 GGUF."""
    from cpuinfer.config import default_model_path

    try:
        path = default_model_path()
    except ValueError as exc:
        pytest.skip(str(exc))
    try:
        from cpuinfer.model_loader import load_model_spec
    except ImportError:
        import os

        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path)).backend_tokenizer
    return load_model_spec(path).tokenizer
