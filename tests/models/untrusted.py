"""Builders of hostile model files for the untrusted-input tests, and the bounds those tests hold loading to."""

from __future__ import annotations

import contextlib
import os
import struct
import time
import tracemalloc

import numpy as np
import pytest

from cpuinfer.config import EngineArgs
from cpuinfer.model_loader import ModelLoadError, load_model_spec
from cpuinfer.worker import ModelRunner

HIDDEN = 64  # one head of 64: the compiled kernels' head size


@contextlib.contextmanager
def bounded(seconds: float = 20.0, mb: float = 64.0):
    """Fail if the block takes longer (a hang detector: generous) or its Python/numpy allocations peak higher."""
    tracemalloc.start()
    start = time.monotonic()
    try:
        yield
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    elapsed = time.monotonic() - start
    assert elapsed < seconds, f"took {elapsed:.1f} s"
    assert peak < mb * 2**20, f"allocated {peak / 2**20:.0f} MB"


def refused(path, match: str, seconds: float = 20.0, mb: float = 64.0):
    """load_model_spec(path) raises a ModelLoadError matching `match`, within the bounds."""
    with bounded(seconds, mb), pytest.raises(ModelLoadError, match=match) as info:
        load_model_spec(str(path))
    return info.value


# ---------------------------------------------------------------------------------------------------------------
# GGUF files from gguf-py's writer: a complete one-layer llama the runner can load, with one thing changed.


def tiny_gguf(
    path,
    tokens=("a", "b", "c", "d"),
    vocab_rows=None,
    tokenizer="gpt2",
    block_count=1,
    context_length=64,
    meta=None,
    merges=(),
):
    """Write a one-layer llama GGUF (F32, tied embeddings); `meta(writer)` adds or overrides metadata."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(block_count)
    w.add_context_length(context_length)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(HIDDEN)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(tokenizer)
    w.add_token_list(list(tokens))
    w.add_token_types([1] * len(tokens))
    if tokenizer == "gpt2":
        w.add_token_merges(list(merges))
    if meta is not None:
        meta(w)
    rng = np.random.default_rng(0)
    mat = lambda rows: (rng.standard_normal((rows, HIDDEN)) * 0.1).astype(np.float32)  # noqa: E731
    w.add_tensor("token_embd.weight", mat(vocab_rows or len(tokens)))
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, dtype=np.float32))
    for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
        w.add_tensor(f"blk.0.{name}.weight", mat(HIDDEN))
    for name in ("attn_norm", "ffn_norm"):
        w.add_tensor(f"blk.0.{name}.weight", np.ones(HIDDEN, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ---------------------------------------------------------------------------------------------------------------
# Raw GGUF bytes, for what gguf-py's writer refuses to express.


def gguf_str(text: str | bytes, length: int | None = None) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data) if length is None else length) + data


def gguf_kv(key: str, vtype: int, payload: bytes) -> bytes:
    return gguf_str(key) + struct.pack("<I", vtype) + payload


def gguf_u32(key: str, value: int) -> bytes:
    return gguf_kv(key, 4, struct.pack("<I", value))


def gguf_tensor(name: str, ggml_dims: tuple[int, ...], type_id: int = 0, offset: int = 0) -> bytes:
    return gguf_str(name) + struct.pack(f"<I{len(ggml_dims)}QIQ", len(ggml_dims), *ggml_dims, type_id, offset)


def raw_gguf(path, kvs=(), tensors=(), data=b"", n_kv=None, n_tensors=None):
    """A GGUF v3 file from pre-encoded key/values and tensor infos (counts may lie), aligned to 32."""
    head = b"GGUF" + struct.pack(
        "<IQQ", 3, len(tensors) if n_tensors is None else n_tensors, len(kvs) if n_kv is None else n_kv
    )
    body = head + b"".join(kvs) + b"".join(tensors)
    path.write_bytes(body + b"\0" * (-len(body) % 32) + data)
    return path


ARCH = gguf_kv("general.architecture", 8, gguf_str("llama"))


HUGE_CONTEXT = 2**31


def check_huge_context(path: str):
    # Default: the declared context is the length; it cannot fit the KV budget, which says so (no allocation).
    with pytest.raises(
        ValueError,
        match=r"max_model_len=2147483648 tokens does not fit the KV cache.*lower "
        r"--max-model-len",
    ):
        EngineArgs(model=path, num_gpu_blocks_override=4, block_size=16).create_engine_config()
    with pytest.raises(ValueError, match="exceeds the model's context length 2147483648"):
        EngineArgs(model=path, max_model_len=HUGE_CONTEXT + 1).create_engine_config()
    config = EngineArgs(
        model=path, max_model_len=64, num_gpu_blocks_override=4, block_size=16, dtype="float32"
    ).create_engine_config()
    assert config.spec.max_model_len == 64
    before = rss_mb()
    runner = ModelRunner(config.spec, config.block_size, config.num_blocks, config.cache_dtype)
    assert rss_mb() - before < 200, "building the runner allocated far more than a tiny model needs"
    assert runner.model.layers[0].plan.attn.cos_sin.shape[0] == 64


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
