"""The one list of KV-cache element types: --kv-cache-dtype's names (besides "auto") and what they mean."""

from __future__ import annotations

import torch

CACHE_DTYPES = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "float32": torch.float32,
    "float": torch.float32,
    "fp8": torch.float8_e5m2,
    "fp8_e5m2": torch.float8_e5m2,
}
