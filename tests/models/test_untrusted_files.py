"""A model file is untrusted input: each hostile file below is a ModelLoadError naming the problem and the fix,
quickly and in bounded memory, never a hang, a crash, a huge allocation or a silently wrong model."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import time
import tracemalloc

import numpy as np
import pytest
import torch

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

def tiny_gguf(path, tokens=("a", "b", "c", "d"), vocab_rows=None, tokenizer="gpt2", block_count=1,
              context_length=64, meta=None, merges=()):
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


def test_tiny_gguf_loads_and_runs(tmp_path):
    """The baseline every case below changes one thing of: it loads, builds and runs."""
    spec = load_model_spec(str(tiny_gguf(tmp_path / "ok.gguf")))
    assert spec.vocab_size == 4 and spec.max_model_len == 64
    runner = ModelRunner(spec, block_size=16, num_blocks=4, cache_dtype=torch.float32)
    from cpuinfer.worker.model_runner import ScheduledSeq

    logits = runner.execute([ScheduledSeq([0, 1, 2], 0, [0], True)])
    assert logits.shape == (1, 4) and torch.isfinite(logits).all()


# ---------------------------------------------------------------------------------------------------------------
# Raw GGUF bytes, for what gguf-py's writer refuses to express.

def _s(text: str | bytes, length: int | None = None) -> bytes:
    data = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(data) if length is None else length) + data


def _kv(key: str, vtype: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", vtype) + payload


def _u32(key: str, value: int) -> bytes:
    return _kv(key, 4, struct.pack("<I", value))


def _tensor(name: str, ggml_dims: tuple[int, ...], type_id: int = 0, offset: int = 0) -> bytes:
    return _s(name) + struct.pack(f"<I{len(ggml_dims)}QIQ", len(ggml_dims), *ggml_dims, type_id, offset)


def raw_gguf(path, kvs=(), tensors=(), data=b"", n_kv=None, n_tensors=None):
    """A GGUF v3 file from pre-encoded key/values and tensor infos (counts may lie), aligned to 32."""
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    body = head + b"".join(kvs) + b"".join(tensors)
    path.write_bytes(body + b"\0" * (-len(body) % 32) + data)
    return path


ARCH = _kv("general.architecture", 8, _s("llama"))


def test_tensor_size_overflow(tmp_path):
    """[2**32, 2**32] float32 is 2**66 bytes; numpy's int64 product wraps to 0 and would pass as an empty tensor."""
    path = raw_gguf(tmp_path / "huge.gguf", [ARCH], [_tensor("token_embd.weight", (2**32, 2**32))], b"\0" * 64)
    refused(path, r"tensor 'token_embd\.weight' runs past the end of the file \(\d{20,} > \d+ bytes\)")
    path = raw_gguf(tmp_path / "wrap.gguf", [ARCH], [_tensor("token_embd.weight", (2**63, 2))], b"\0" * 64)
    refused(path, "runs past the end of the file")


def test_tensor_row_not_whole_blocks(tmp_path):
    path = raw_gguf(tmp_path / "q4.gguf", [ARCH], [_tensor("token_embd.weight", (33, 4), type_id=2)], b"\0" * 256)
    refused(path, r"tensor 'token_embd\.weight' has rows of 33 elements, not a multiple of its type's block of 32")


@pytest.mark.parametrize("dims", [(), (1, 1, 1, 1, 1), (0, 4)])
def test_tensor_bad_dims(tmp_path, dims):
    path = raw_gguf(tmp_path / "dims.gguf", [ARCH], [_tensor("token_embd.weight", dims)], b"\0" * 64)
    refused(path, r"tensor 'token_embd\.weight' has (\d+ dimensions; GGUF allows 1 to 4|shape .* empty dimension)")


def test_duplicate_tensor_and_key(tmp_path):
    info = _tensor("token_embd.weight", (4,))
    refused(raw_gguf(tmp_path / "t.gguf", [ARCH], [info, info], b"\0" * 64), "'token_embd.weight' appears twice")
    refused(raw_gguf(tmp_path / "k.gguf", [ARCH, ARCH]), "metadata key 'general.architecture' appears twice")


@pytest.mark.parametrize("alignment", [0, 3, 48, 2**31])
def test_bad_alignment(tmp_path, alignment):
    path = raw_gguf(tmp_path / "align.gguf", [ARCH, _u32("general.alignment", alignment)],
                    [_tensor("token_embd.weight", (4,))], b"\0" * 64)
    refused(path, rf"general\.alignment = {alignment} is not a power of two between 1 and \d+")


def test_alignment_of_wrong_type(tmp_path):
    path = raw_gguf(tmp_path / "align.gguf", [ARCH, _kv("general.alignment", 8, _s("32"))])
    refused(path, r"general\.alignment = '32' is not a power of two")


@pytest.mark.parametrize("depth", [6, 100_000])
def test_deeply_nested_arrays(tmp_path, depth):
    """Arrays of arrays past a small depth are refused before Python's recursion limit is near."""
    nested = struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 0)
    path = raw_gguf(tmp_path / "nest.gguf", [ARCH, _kv("evil.nested", 9, nested)])
    refused(path, r"metadata 'evil\.nested' nests arrays more than \d+ deep")


def test_nested_arrays_gguf_py_writes_still_read(tmp_path):
    """A shallow array of arrays (gguf-py can write them) is read, not refused."""
    from cpuinfer.model_loader.gguf_reader import GGUFReader

    def meta(w):
        w.add_array("extra.pairs", [[1, 2], [3, 4]])

    reader = GGUFReader(str(tiny_gguf(tmp_path / "pairs.gguf", meta=meta)))
    assert reader.fields["extra.pairs"] == [[1, 2], [3, 4]]


@pytest.mark.parametrize("item_type,what", [(0, "u8"), (8, "string"), (9, "array")])
def test_array_count_beyond_file(tmp_path, item_type, what):
    """A count of 2**60 is compared with the bytes left, never allocated (nor looped over)."""
    path = raw_gguf(tmp_path / f"{what}.gguf", [ARCH, _kv("evil.array", 9, struct.pack("<IQ", item_type, 2**60))])
    refused(path, r"metadata 'evil\.array' declares 1152921504606846976 array items, more than the \d+ bytes left",
            seconds=5, mb=8)


def test_string_length_beyond_file(tmp_path):
    path = raw_gguf(tmp_path / "str.gguf", [ARCH, _kv("evil.string", 8, _s(b"abc", length=2**60))])
    refused(path, r"metadata 'evil\.string' declares 1152921504606846976 bytes, more than the \d+ bytes left",
            seconds=5, mb=8)
    key = struct.pack("<Q", 2**60) + b"general.architecture"
    refused(raw_gguf(tmp_path / "key.gguf", [key]), "a string declares 1152921504606846976 bytes", seconds=5, mb=8)


def test_header_counts_beyond_file(tmp_path):
    refused(raw_gguf(tmp_path / "kv.gguf", [ARCH], n_kv=2**60), "the header declares 1152921504606846976 metadata",
            seconds=5, mb=8)
    refused(raw_gguf(tmp_path / "t.gguf", [ARCH], n_tensors=2**60), "the header declares 1152921504606846976 tensor",
            seconds=5, mb=8)


@pytest.mark.parametrize("scalar", [True, False])
def test_unknown_value_type(tmp_path, scalar):
    payload = b"\0" * 8 if scalar else struct.pack("<IQ", 99, 1) + b"\0" * 8
    path = raw_gguf(tmp_path / "type.gguf", [ARCH, _kv("evil.value", 99 if scalar else 9, payload)])
    refused(path, r"metadata 'evil\.value' (is an array of|has) unknown value type 99")


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer metadata.

@pytest.mark.parametrize("tokenizer", ["llama", "gpt2"])
def test_huge_token(tmp_path, tokenizer):
    """Building SentencePiece merges is quadratic in a token's length: a 200,000-character token is refused."""
    path = tiny_gguf(tmp_path / "long.gguf", tokens=("a", "b", "c", "a" * 200_000), tokenizer=tokenizer)
    refused(path, r"token 3 \(tokenizer\.ggml\.tokens\) is 200000 characters long; cpuinfer accepts tokens of up "
                  r"to \d+", seconds=10)


def test_longest_allowed_token_loads_quickly(tmp_path):
    from cpuinfer.model_loader.gguf_tokenizer import MAX_TOKEN_CHARS

    tokens = ["a", "b"] + ["a" * n for n in range(2, 9)] + ["b" * MAX_TOKEN_CHARS]
    with bounded(seconds=10):
        spec = load_model_spec(str(tiny_gguf(tmp_path / "long.gguf", tokens=tokens, tokenizer="llama")))
    assert spec.tokenizer.token_to_id("b" * MAX_TOKEN_CHARS) == 9


@pytest.mark.parametrize("tokens", [[1, 2], "abcd"])
def test_tokens_not_strings(tokens):
    from cpuinfer.model_loader.gguf_tokenizer import tokenizer_from_gguf

    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.tokens": tokens}
    with pytest.raises(ModelLoadError, match="tokenizer.ggml.tokens is not a list of strings"):
        tokenizer_from_gguf(fields.get, "x.gguf")


@pytest.mark.parametrize("merges,match", [
    (["ab"], 'tokenizer.ggml.merges is not a list of "left right" strings'),
    (["x y"], r"the GGUF tokenizer cannot be built \(.*\); the file is corrupt"),
    (["a b"] * 10, r"tokenizer.ggml.merges has 10 merges, more than the \d+ ways to split"),
])
def test_bad_merges(tmp_path, merges, match):
    path = tiny_gguf(tmp_path / "merges.gguf", tokens=("a", "b", "ab", "c"), merges=merges)
    refused(path, match)


@pytest.mark.parametrize("key", ["bos", "eos", "unknown", "padding", "eot"])
@pytest.mark.parametrize("value", [4, 2**31, -1])
def test_special_token_id_out_of_range(tmp_path, key, value):
    def meta(w):
        if value < 0:
            w.add_int32(f"tokenizer.ggml.{key}_token_id", value)
        else:
            w.add_uint32(f"tokenizer.ggml.{key}_token_id", value)

    path = tiny_gguf(tmp_path / "ids.gguf", meta=meta)
    refused(path, rf"tokenizer\.ggml\.{key}_token_id = {value} is not a token id \(0 to 3\)")


# ---------------------------------------------------------------------------------------------------------------
# The model's numbers: vocab against the embedding, layer and head counts, context length.

def test_more_tokens_than_embedding_rows(tmp_path):
    path = tiny_gguf(tmp_path / "vocab.gguf", tokens=("a", "b", "c", "d", "e"), vocab_rows=4)
    refused(path, r"the tokenizer has 5 tokens \(tokenizer\.ggml\.tokens\) but the embedding token_embd\.weight has "
                  r"only 4 rows")


def test_fewer_tokens_than_embedding_rows_is_padding(tmp_path):
    spec = load_model_spec(str(tiny_gguf(tmp_path / "pad.gguf", vocab_rows=8)))
    assert spec.vocab_size == 8  # the logits' width; ids 4..7 simply never decode to text


def test_declared_vocab_size_disagrees_with_embedding(tmp_path):
    path = tiny_gguf(tmp_path / "vocab.gguf", meta=lambda w: w.add_vocab_size(100))
    refused(path, r"llama\.vocab_size = 100 but token_embd\.weight has 4 rows")


@pytest.mark.parametrize("key,value,match", [
    ("llama.attention.head_count", 0, r"llama\.attention\.head_count = 0 is not a positive integer"),
    ("llama.attention.head_count_kv", 0, r"llama\.attention\.head_count_kv = 0 is not a positive integer"),
    ("llama.embedding_length", 0, r"llama\.embedding_length = 0 is not a positive integer"),
    ("llama.block_count", 2**40, r"llama\.block_count = 1099511627776 is not a plausible layer count"),
    ("llama.block_count", 3, r"llama\.block_count = 3, but the file has tensors for 1 layer\(s\)"),
    ("llama.context_length", 0, r"llama\.context_length = 0 is not a positive integer"),
    ("llama.attention.layer_norm_rms_epsilon", float("nan"), r"layer_norm_rms_epsilon = nan is not a finite"),
])
def test_bad_model_numbers(tmp_path, key, value, match):
    import gguf

    def meta(w):
        vtype = gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else (
            gguf.GGUFValueType.UINT64 if value >= 2**32 else gguf.GGUFValueType.UINT32)
        w.add_key_value(key, value, vtype)  # overwrites what tiny_gguf wrote (gguf-py warns)

    refused(tiny_gguf(tmp_path / "bad.gguf", meta=meta), match)


HUGE_CONTEXT = 2**31


def test_huge_gguf_context_sizes_nothing_from_it(tmp_path):
    """context_length 2**31: rotary tables and KV cache follow the effective --max-model-len, not the file."""
    path = str(tiny_gguf(tmp_path / "ctx.gguf", context_length=HUGE_CONTEXT))
    with bounded(seconds=20):
        spec = load_model_spec(path)
    assert spec.max_model_len == HUGE_CONTEXT
    _check_huge_context(path)


def _check_huge_context(path: str):
    # Default: the declared context is the length; it cannot fit the KV budget, which says so (no allocation).
    with pytest.raises(ValueError, match=r"max_model_len=2147483648 tokens does not fit the KV cache.*lower "
                                         r"--max-model-len"):
        EngineArgs(model=path, num_gpu_blocks_override=4, block_size=16).create_engine_config()
    with pytest.raises(ValueError, match="exceeds the model's context length 2147483648"):
        EngineArgs(model=path, max_model_len=HUGE_CONTEXT + 1).create_engine_config()
    config = EngineArgs(model=path, max_model_len=64, num_gpu_blocks_override=4, block_size=16,
                        dtype="float32").create_engine_config()
    assert config.spec.max_model_len == 64
    before = _rss_mb()
    runner = ModelRunner(config.spec, config.block_size, config.num_blocks, config.cache_dtype)
    assert _rss_mb() - before < 200, "building the runner allocated far more than a tiny model needs"
    assert runner.model.layers[0].attn.cos_sin.shape[0] == 64


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def test_yarn_table_does_not_depend_on_its_length():
    """YaRN without original_max_position_embeddings falls back to the declared context, not the table length."""
    from cpuinfer.models.rotary import cos_sin_cache, rope_parameters

    config = {"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    short = cos_sin_cache(rope_parameters(config), 64, 16)
    long = cos_sin_cache(rope_parameters(config), 64, 256)
    torch.testing.assert_close(short, long[:16])


# ---------------------------------------------------------------------------------------------------------------
# Hugging Face directories.

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=1, num_key_value_heads=1, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("tiny_llama")
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


def _copy(src, tmp_path, name="model"):
    dst = tmp_path / name
    shutil.copytree(src, dst)
    return dst


def _edit_config(d, **changes):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(changes)
    (d / "config.json").write_text(json.dumps(cfg))


def _write_tokenizer(d, n_tokens: int):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {f"t{i}": i for i in range(n_tokens)}
    Tokenizer(WordLevel(vocab, unk_token="t0")).save(str(d / "tokenizer.json"))


def test_hf_huge_context_sizes_nothing_from_it(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    _edit_config(d, max_position_embeddings=HUGE_CONTEXT)
    _check_huge_context(str(d))


def test_hf_vocab_size_disagrees_with_embedding(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    _edit_config(d, vocab_size=65)
    spec = load_model_spec(str(d))
    with pytest.raises(ModelLoadError, match=r"config\.json: vocab_size = 65 but (model\.embed_tokens|lm_head)\.weight "
                                             r"has 64 rows; the config and weights do not belong together"):
        ModelRunner(spec, 16, 4, torch.float32)


def test_hf_tokenizer_larger_than_vocab(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    _write_tokenizer(d, 100)
    refused(d, r"the tokenizer has 100 tokens but the model's vocab_size is 64; the tokenizer belongs to another "
               r"model")


def test_hf_tokenizer_smaller_than_vocab_is_padding(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    _write_tokenizer(d, 50)
    assert load_model_spec(str(d)).vocab_size == 64


@pytest.mark.parametrize("changes,match", [
    (dict(num_attention_heads=0), r"config\.json: num_attention_heads = 0 is not a positive integer"),
    (dict(num_hidden_layers=2**40), r"num_hidden_layers = 1099511627776 is not a plausible layer count"),
    (dict(num_hidden_layers="2"), r"num_hidden_layers = '2' is not a positive integer"),
    (dict(num_attention_heads=3, num_key_value_heads=2), r"num_key_value_heads = 2 is not a divisor of the 3"),
    (dict(max_position_embeddings=-1), r"max_position_embeddings = -1 is not a positive integer"),
    (dict(rope_theta=float("inf")), r"rope_theta = inf is not a finite positive number"),
    (dict(eos_token_id=64), r"eos token id 64 is not a token id of the 64-token vocabulary"),
    (dict(bos_token_id=-1), r"bos token id -1 is not a token id of the 64-token vocabulary"),
])
def test_hf_bad_config_numbers(tiny_dir, tmp_path, changes, match):
    d = _copy(tiny_dir, tmp_path)
    _edit_config(d, **changes)
    (d / "generation_config.json").unlink(missing_ok=True)  # its ids would be read first
    refused(d, match)


def test_hf_config_not_an_object_or_too_deep(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    (d / "config.json").write_text("[1, 2]")
    refused(d, r"config\.json holds a JSON list, not an object")
    (d / "config.json").write_text("[" * 100_000 + "]" * 100_000)
    refused(d, r"config\.json is not valid JSON: RecursionError")


def _sharded(tiny_dir, tmp_path, shard_name: str):
    d = _copy(tiny_dir, tmp_path)
    index = {"metadata": {}, "weight_map": {"model.embed_tokens.weight": shard_name}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


@pytest.mark.parametrize("shard", ["../outside.safetensors", "sub/../../outside.safetensors",
                                   "/etc/outside.safetensors", "..\\outside.safetensors"])
def test_weight_map_outside_directory(tiny_dir, tmp_path, shard):
    (tmp_path / "outside.safetensors").write_bytes((tiny_dir / "model.safetensors").read_bytes())
    d = _sharded(tiny_dir, tmp_path, shard)
    refused(d, r"model\.safetensors\.index\.json: weight_map names shard .*, a path outside the model directory")


def test_weight_map_symlink_outside_directory(tiny_dir, tmp_path):
    outside = tmp_path / "elsewhere.safetensors"
    shutil.copy(tiny_dir / "model.safetensors", outside)
    d = _sharded(tiny_dir, tmp_path, "link.safetensors")
    (d / "link.safetensors").symlink_to(outside)
    refused(d, r"weight file\(s\) .*link\.safetensors are symlinks to .*elsewhere\.safetensors, outside the model "
               r"directory; copy the real files into the directory")
    (d / "model.safetensors.index.json").unlink()  # the unsharded layout: every *.safetensors is checked too
    refused(d, "link.safetensors are symlinks to")


def test_weight_map_not_a_mapping(tiny_dir, tmp_path):
    d = _copy(tiny_dir, tmp_path)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": 3}}))
    refused(d, r"weight_map is not an object of tensor name -> shard file name")


def test_hugging_face_cache_snapshot_symlinks_load(tiny_dir, tmp_path):
    """A hub cache snapshot's files are symlinks into the repository's blobs folder: that stays allowed."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in os.listdir(tiny_dir):
        blob = repo / "blobs" / f"sha-{f}"
        shutil.copy(tiny_dir / f, blob)
        (snapshot / f).symlink_to(os.path.relpath(blob, snapshot))
    spec = load_model_spec(str(snapshot))
    ModelRunner(spec, 16, 4, torch.float32)


# ---------------------------------------------------------------------------------------------------------------
# Rope scaling metadata and the chat template.

@pytest.mark.parametrize("key,value,match", [
    ("llama.rope.scaling.factor", float("nan"), r"llama\.rope\.scaling\.factor = nan is not a finite positive"),
    ("llama.rope.scaling.factor", "8", r"llama\.rope\.scaling\.factor = '8' is not a finite positive number"),
    ("llama.rope.scaling.original_context_length", -5, r"original_context_length = -5 is not a positive integer"),
    ("llama.final_logit_softcapping", float("inf"), r"final_logit_softcapping = inf is not a finite non-negative"),
])
def test_bad_rope_scaling_and_softcap(tmp_path, key, value, match):
    import gguf

    def meta(w):
        w.add_string("llama.rope.scaling.type", "linear")
        vtype = {str: gguf.GGUFValueType.STRING, float: gguf.GGUFValueType.FLOAT32}.get(type(value),
                                                                                        gguf.GGUFValueType.INT32)
        w.add_key_value(key, value, vtype)

    refused(tiny_gguf(tmp_path / "rope.gguf", meta=meta), match)


def test_rope_freqs_of_wrong_size(tmp_path):
    def meta(w):
        w.add_tensor("rope_freqs.weight", np.ones(5, dtype=np.float32))  # 64-dim heads have 32 frequencies

    spec = load_model_spec(str(tiny_gguf(tmp_path / "freqs.gguf", meta=meta)))
    with pytest.raises(ModelLoadError, match=r"rope_freqs\.weight has 5 factors, but the rotary dimension 64 has 32"):
        ModelRunner(spec, 16, 4, torch.float32)


def test_chat_template_not_text(tmp_path):
    path = tiny_gguf(tmp_path / "tmpl.gguf", meta=lambda w: w.add_uint32("tokenizer.chat_template", 7))
    refused(path, r"the chat template is a int, not text")
