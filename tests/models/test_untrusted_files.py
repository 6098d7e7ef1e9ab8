"""A model file is untrusted input: each hostile GGUF below is a ModelLoadError naming the problem and the fix,
quickly and in bounded memory, never a hang, a crash, a huge allocation or a silently wrong model."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch

from cpuinfer.model_loader import ModelLoadError, load_model_spec
from cpuinfer.worker import ModelRunner

from .untrusted import (
    ARCH,
    HUGE_CONTEXT,
    bounded,
    check_huge_context,
    gguf_kv,
    gguf_str,
    gguf_tensor,
    gguf_u32,
    raw_gguf,
    refused,
    tiny_gguf,
)


def test_tiny_gguf_loads_and_runs(tmp_path):
    """The baseline every case below changes one thing of: it loads, builds and runs."""
    spec = load_model_spec(str(tiny_gguf(tmp_path / "ok.gguf")))
    assert spec.vocab_size == 4 and spec.max_model_len == 64
    runner = ModelRunner(spec, block_size=16, num_blocks=4, cache_dtype=torch.float32)
    from cpuinfer.engine.step import ScheduledSeq

    logits = runner.execute([ScheduledSeq([0, 1, 2], 0, [0], True)])
    assert logits.shape == (1, 4) and torch.isfinite(logits).all()


def test_tensor_size_overflow(tmp_path):
    """[2**32, 2**32] float32 is 2**66 bytes; numpy's int64 product wraps to 0 and would pass as an empty tensor."""
    path = raw_gguf(tmp_path / "huge.gguf", [ARCH], [gguf_tensor("token_embd.weight", (2**32, 2**32))], b"\0" * 64)
    refused(path, r"tensor 'token_embd\.weight' runs past the end of the file \(\d{20,} > \d+ bytes\)")
    path = raw_gguf(tmp_path / "wrap.gguf", [ARCH], [gguf_tensor("token_embd.weight", (2**63, 2))], b"\0" * 64)
    refused(path, "runs past the end of the file")


def test_tensor_row_not_whole_blocks(tmp_path):
    path = raw_gguf(tmp_path / "q4.gguf", [ARCH], [gguf_tensor("token_embd.weight", (33, 4), type_id=2)], b"\0" * 256)
    refused(path, r"tensor 'token_embd\.weight' has rows of 33 elements, not a multiple of its type's block of 32")


@pytest.mark.parametrize("dims", [(), (1, 1, 1, 1, 1), (0, 4)])
def test_tensor_bad_dims(tmp_path, dims):
    path = raw_gguf(tmp_path / "dims.gguf", [ARCH], [gguf_tensor("token_embd.weight", dims)], b"\0" * 64)
    refused(path, r"tensor 'token_embd\.weight' has (\d+ dimensions; GGUF allows 1 to 4|shape .* empty dimension)")


def test_duplicate_tensor_and_key(tmp_path):
    info = gguf_tensor("token_embd.weight", (4,))
    refused(raw_gguf(tmp_path / "t.gguf", [ARCH], [info, info], b"\0" * 64), "'token_embd.weight' appears twice")
    refused(raw_gguf(tmp_path / "k.gguf", [ARCH, ARCH]), "metadata key 'general.architecture' appears twice")


@pytest.mark.parametrize("alignment", [0, 3, 48, 2**31])
def test_bad_alignment(tmp_path, alignment):
    path = raw_gguf(
        tmp_path / "align.gguf",
        [ARCH, gguf_u32("general.alignment", alignment)],
        [gguf_tensor("token_embd.weight", (4,))],
        b"\0" * 64,
    )
    refused(path, rf"general\.alignment = {alignment} is not a power of two between 1 and \d+")


def test_alignment_of_wrong_type(tmp_path):
    path = raw_gguf(tmp_path / "align.gguf", [ARCH, gguf_kv("general.alignment", 8, gguf_str("32"))])
    refused(path, r"general\.alignment = '32' is not a power of two")


@pytest.mark.parametrize("depth", [6, 100_000])
def test_deeply_nested_arrays(tmp_path, depth):
    """Arrays of arrays past a small depth are refused before Python's recursion limit is near."""
    nested = struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 4, 0)
    path = raw_gguf(tmp_path / "nest.gguf", [ARCH, gguf_kv("evil.nested", 9, nested)])
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
    path = raw_gguf(tmp_path / f"{what}.gguf", [ARCH, gguf_kv("evil.array", 9, struct.pack("<IQ", item_type, 2**60))])
    refused(
        path,
        r"metadata 'evil\.array' declares 1152921504606846976 array items, more than the \d+ bytes left",
        seconds=5,
        mb=8,
    )


def test_string_length_beyond_file(tmp_path):
    path = raw_gguf(tmp_path / "str.gguf", [ARCH, gguf_kv("evil.string", 8, gguf_str(b"abc", length=2**60))])
    refused(
        path,
        r"metadata 'evil\.string' declares 1152921504606846976 bytes, more than the \d+ bytes left",
        seconds=5,
        mb=8,
    )
    key = struct.pack("<Q", 2**60) + b"general.architecture"
    refused(raw_gguf(tmp_path / "key.gguf", [key]), "a string declares 1152921504606846976 bytes", seconds=5, mb=8)


def test_header_counts_beyond_file(tmp_path):
    refused(
        raw_gguf(tmp_path / "kv.gguf", [ARCH], n_kv=2**60),
        "the header declares 1152921504606846976 metadata",
        seconds=5,
        mb=8,
    )
    refused(
        raw_gguf(tmp_path / "t.gguf", [ARCH], n_tensors=2**60),
        "the header declares 1152921504606846976 tensor",
        seconds=5,
        mb=8,
    )


@pytest.mark.parametrize("scalar", [True, False])
def test_unknown_value_type(tmp_path, scalar):
    payload = b"\0" * 8 if scalar else struct.pack("<IQ", 99, 1) + b"\0" * 8
    path = raw_gguf(tmp_path / "type.gguf", [ARCH, gguf_kv("evil.value", 99 if scalar else 9, payload)])
    refused(path, r"metadata 'evil\.value' (is an array of|has) unknown value type 99")


# ---------------------------------------------------------------------------------------------------------------
# Tokenizer metadata.


@pytest.mark.parametrize("tokenizer", ["llama", "gpt2"])
def test_huge_token(tmp_path, tokenizer):
    """Building SentencePiece merges is quadratic in a token's length: a 200,000-character token is refused."""
    path = tiny_gguf(tmp_path / "long.gguf", tokens=("a", "b", "c", "a" * 200_000), tokenizer=tokenizer)
    refused(
        path,
        r"token 3 \(tokenizer\.ggml\.tokens\) is 200000 characters long; cpuinfer accepts tokens of up "
        r"to \d+",
        seconds=10,
    )


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
    with pytest.raises(ModelLoadError, match=r"tokenizer\.ggml\.tokens is not a list of strings"):
        tokenizer_from_gguf(fields.get, "x.gguf")


@pytest.mark.parametrize(
    "merges,match",
    [
        (["ab"], 'tokenizer.ggml.merges is not a list of "left right" strings'),
        (["x y"], r"the GGUF tokenizer cannot be built \(.*\); the file is corrupt"),
        (["a b"] * 10, r"tokenizer.ggml.merges has 10 merges, more than the \d+ ways to split"),
    ],
)
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
    refused(
        path,
        r"the tokenizer has 5 tokens \(tokenizer\.ggml\.tokens\) but the embedding token_embd\.weight has "
        r"only 4 rows",
    )


def test_fewer_tokens_than_embedding_rows_is_padding(tmp_path):
    spec = load_model_spec(str(tiny_gguf(tmp_path / "pad.gguf", vocab_rows=8)))
    assert spec.vocab_size == 8  # the logits' width; ids 4..7 simply never decode to text


def test_declared_vocab_size_disagrees_with_embedding(tmp_path):
    path = tiny_gguf(tmp_path / "vocab.gguf", meta=lambda w: w.add_vocab_size(100))
    refused(path, r"llama\.vocab_size = 100 but token_embd\.weight has 4 rows")


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("llama.attention.head_count", 0, r"llama\.attention\.head_count = 0 is not a positive integer"),
        ("llama.attention.head_count_kv", 0, r"llama\.attention\.head_count_kv = 0 is not a positive integer"),
        ("llama.embedding_length", 0, r"llama\.embedding_length = 0 is not a positive integer"),
        ("llama.block_count", 2**40, r"llama\.block_count = 1099511627776 is not a plausible layer count"),
        ("llama.block_count", 3, r"llama\.block_count = 3, but the file has tensors for 1 layer\(s\)"),
        ("llama.context_length", 0, r"llama\.context_length = 0 is not a positive integer"),
        ("llama.attention.layer_norm_rms_epsilon", float("nan"), r"layer_norm_rms_epsilon = nan is not a finite"),
    ],
)
def test_bad_model_numbers(tmp_path, key, value, match):
    import gguf

    def meta(w):
        vtype = (
            gguf.GGUFValueType.FLOAT32
            if isinstance(value, float)
            else (gguf.GGUFValueType.UINT64 if value >= 2**32 else gguf.GGUFValueType.UINT32)
        )
        w.add_key_value(key, value, vtype)  # overwrites what tiny_gguf wrote (gguf-py warns)

    refused(tiny_gguf(tmp_path / "bad.gguf", meta=meta), match)


def test_huge_gguf_context_sizes_nothing_from_it(tmp_path):
    """context_length 2**31: rotary tables and KV cache follow the effective --max-model-len, not the file."""
    path = str(tiny_gguf(tmp_path / "ctx.gguf", context_length=HUGE_CONTEXT))
    with bounded(seconds=20):
        spec = load_model_spec(path)
    assert spec.max_model_len == HUGE_CONTEXT
    check_huge_context(path)


def test_yarn_table_does_not_depend_on_its_length():
    """YaRN without original_max_position_embeddings falls back to the declared context, not the table length."""
    from cpuinfer.models.rotary import cos_sin_cache, rope_parameters

    config = {"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}}
    short = cos_sin_cache(rope_parameters(config), 64, 16)
    long = cos_sin_cache(rope_parameters(config), 64, 256)
    torch.testing.assert_close(short, long[:16])


# ---------------------------------------------------------------------------------------------------------------
# Rope scaling metadata and the chat template.


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("llama.rope.scaling.factor", float("nan"), r"llama\.rope\.scaling\.factor = nan is not a finite positive"),
        ("llama.rope.scaling.factor", "8", r"llama\.rope\.scaling\.factor = '8' is not a finite positive number"),
        ("llama.rope.scaling.original_context_length", -5, r"original_context_length = -5 is not a positive integer"),
        ("llama.final_logit_softcapping", float("inf"), r"final_logit_softcapping = inf is not a finite non-negative"),
    ],
)
def test_bad_rope_scaling_and_softcap(tmp_path, key, value, match):
    import gguf

    def meta(w):
        w.add_string("llama.rope.scaling.type", "linear")
        vtype = {str: gguf.GGUFValueType.STRING, float: gguf.GGUFValueType.FLOAT32}.get(
            type(value), gguf.GGUFValueType.INT32
        )
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
