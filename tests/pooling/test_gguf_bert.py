"""BERT embedding models as GGUF (llama.cpp's `bert` architecture), the file written by llama.cpp's own converter
(tests/models/llama_cpp_convert.py) from a tiny random BertModel with all-MiniLM's real WordPiece vocabulary, mean
pooling, normalised, as sentence-transformers saves it.

- The tokenizer built from the file's vocabulary (tokenizer.ggml.model = bert) gives the ids of the checkpoint's
  own tokenizer.json, pairs' token types included.
- The f32 file in a float32 run: sentence-transformers' `encode` within 1e-5; the pooling read from
  bert.pooling_type (MEAN here, CLS in a rewritten copy).
- A Q8_0 file (gguf-py's quantizer, as the converter's --outtype q8_0) in a bfloat16 run keeps its matrices packed
  for the integer kernels, its vectors within a stated cosine of the f32 file's.
- Where llama-cpp-python imports (CPUINFER_LLAMA_PYTHON): llama.cpp's own embeddings and token ids of the same
  files, a Q4_K_M from llama.cpp's quantizer among them.
- Bad files: a missing tensor, a reranker, no pooling, positions past the table, an architecture the engine has no
  encoder for: a ModelLoadError (or the pooler's ValueError) naming the field and the file.
"""

from __future__ import annotations

import os

import pytest
import torch

from cpuinfer.model_loader import ModelLoadError, load_model_spec

from ..models.llama_cpp_convert import convert, llama_python, llama_quantize, rewrite_tensors, with_quantized
from .test_bert import TEXTS as BERT_TEXTS
from .test_bert import minilm_dir
from .tiny_embedders import write_sentence_transformers
from .tiny_encoders import link_bert_tokenizer

transformers = pytest.importorskip("transformers")
pytest.importorskip("sentence_transformers")

HIDDEN = 256  # a multiple of 256: llama.cpp's quantizer writes K-quants for every matrix
# test_bert's texts, and what a WordPiece normaliser must get right: accents, CJK, symbols, words it has no piece for
TEXTS = [
    *BERT_TEXTS,
    "Héllo wörld, naïve café! Ünïcödé ÀÉÎÕÜ — “quotes” & 東京タワー x² 3.14",
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tiny checkpoint (hf), its f32 GGUF from llama.cpp's converter, and a Q8_0 copy."""
    path = tmp_path_factory.mktemp("gguf_bert")
    hf = path / "hf"
    cfg = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=4,  # head size 64: the paged attention kernel runs it
        intermediate_size=512,
        max_position_embeddings=512,
        initializer_range=0.1,
    )
    torch.manual_seed(7)
    transformers.BertModel(cfg).float().eval().save_pretrained(hf)
    link_bert_tokenizer(hf, minilm_dir())
    write_sentence_transformers(hf, "mean", True, dim=HIDDEN)
    f32 = convert(str(hf), str(path / "bert.f32.gguf"), "f32")
    # What the converter's --outtype q8_0 quantizes: the word embeddings and every layer's matrices.
    q8 = with_quantized(
        f32,
        str(path / "bert.q8_0.gguf"),
        lambda n: n.startswith(("token_embd.", "blk.")) and "norm" not in n and n.endswith("weight"),
    )
    return {"hf": str(hf), "f32": f32, "q8_0": q8, "dir": path}


def st_encode(model, texts: list[str]) -> torch.Tensor:
    return torch.tensor(model.encode(texts, batch_size=1))


def embed(path: str, dtype: str, texts: list[str] = TEXTS, **kwargs) -> torch.Tensor:
    from cpuinfer import LLM

    llm = LLM(path, dtype=dtype, block_size=16, **kwargs)
    return torch.tensor([o.outputs.embedding for o in llm.embed(texts, use_tqdm=False)])


def test_tokenizer_from_the_gguf_vocabulary(files):
    """The WordPiece tokenizer built from llama.cpp's form of the vocabulary: the ids of the checkpoint's own
    tokenizer.json (lowercased, accents stripped, CJK split, unknown words), and a pair's token types."""
    from tokenizers import Tokenizer

    spec = load_model_spec(files["f32"], "float32")
    ref = Tokenizer.from_file(os.path.join(files["hf"], "tokenizer.json"))
    ref.no_padding()
    ref.no_truncation()
    for text in TEXTS:
        assert spec.tokenizer.encode(text).ids == ref.encode(text).ids, text
    ours, theirs = spec.tokenizer.encode(TEXTS[0], TEXTS[2]), ref.encode(TEXTS[0], TEXTS[2])
    assert (ours.ids, ours.type_ids) == (theirs.ids, theirs.type_ids)
    assert spec.tokenizer.decode(ours.ids) == ref.decode(theirs.ids)


def test_f32_gguf_equals_sentence_transformers(files):
    """float32: sentence-transformers' vectors within 1e-5, mean pooling and normalisation as the file says."""
    from sentence_transformers import SentenceTransformer

    spec = load_model_spec(files["f32"], "float32")
    assert (spec.architecture, spec.hf_config["gguf_pooling_type"]) == ("BertModel", "MEAN")
    ref = st_encode(SentenceTransformer(files["hf"], device="cpu"), TEXTS)
    torch.testing.assert_close(embed(files["f32"], "float32"), ref, atol=1e-5, rtol=0)


def test_cls_pooling_from_the_file(files):
    """bert.pooling_type = CLS (2) in a copy of the file: sentence-transformers' CLS-pooled vectors."""
    from sentence_transformers import SentenceTransformer, models

    cls = rewrite_tensors(files["f32"], str(files["dir"] / "bert.cls.gguf"), fields={"bert.pooling_type": 2})
    body = models.Transformer(files["hf"])
    st = SentenceTransformer(modules=[body, models.Pooling(HIDDEN, "cls"), models.Normalize()], device="cpu")
    torch.testing.assert_close(embed(cls, "float32"), st_encode(st, TEXTS), atol=1e-5, rtol=0)


def test_q8_0_stays_packed_and_close(files):
    """Q8_0 in a bfloat16 run: every layer matrix packed for the integer kernels (QKV as one), the vectors close to
    the f32 file's float32 ones and to the Q8_0 file's own float32 run (gguf-py's dequantization: the format's
    exact reference)."""
    from cpuinfer.quantization import is_quantized
    from cpuinfer.worker import ModelRunner

    runner = ModelRunner(load_model_spec(files["q8_0"], "bfloat16"), block_size=16, num_blocks=64)
    for layer in runner.model.layers:
        assert all(is_quantized(w) for w in (layer.qkv_w, layer.out_w, layer.up_w, layer.down_w))
        assert layer.qkv_w.shape == (3 * HIDDEN, HIDDEN)
    del runner
    ours = embed(files["q8_0"], "bfloat16")
    exact = embed(files["q8_0"], "float32")
    f32 = embed(files["f32"], "float32")
    cos_exact = torch.nn.functional.cosine_similarity(ours, exact, dim=-1)
    cos_f32 = torch.nn.functional.cosine_similarity(ours, f32, dim=-1)
    print(f"Q8_0 bf16 run: cosine to its float32 run min {cos_exact.min():.6f}, to the f32 file's {cos_f32.min():.6f}")
    # Measured (Sapphire Rapids, amx; 8 texts): min cosine 0.99989 to the file's float32 run, 0.99975 to the f32
    # file's (Q8_0's rounding of the weights, bf16 and int8 activations); 1 - cosine has 4x headroom at 0.999.
    assert cos_exact.min() >= 0.999, cos_exact
    assert cos_f32.min() >= 0.999, cos_f32


def _without(files, name: str, drop) -> str:
    return rewrite_tensors(files["f32"], str(files["dir"] / name), lambda _, t: False if drop(t.name) else None)


def test_bad_files_name_the_field_and_file(files):
    d = files["dir"]
    bad = _without(files, "missing.gguf", lambda n: n == "blk.1.ffn_down.bias")
    with pytest.raises(ModelLoadError, match=r"missing.gguf.*'blk\.1\.ffn_down\.bias' is missing"):
        load_model_spec(bad, "float32")
    long = rewrite_tensors(files["f32"], str(d / "long.gguf"), fields={"bert.context_length": 4096})
    with pytest.raises(ModelLoadError, match=r"long.gguf: bert.context_length = 4096.*512 rows"):
        load_model_spec(long, "float32")
    rank = rewrite_tensors(files["f32"], str(d / "rank.gguf"), fields={"bert.pooling_type": 4})
    with pytest.raises(ModelLoadError, match=r"rank.gguf: a BERT reranker"):
        load_model_spec(rank, "float32")
    types = rewrite_tensors(files["f32"], str(d / "types.gguf"), fields={"tokenizer.ggml.token_type_count": 3})
    with pytest.raises(ModelLoadError, match=r"types.gguf: tokenizer.ggml.token_type_count = 3"):
        load_model_spec(types, "float32")
    other = rewrite_tensors(files["f32"], str(d / "nomic.gguf"), fields={"general.architecture": "nomic-bert"})
    with pytest.raises(ModelLoadError, match=r"nomic.gguf: GGUF architecture 'nomic-bert' is not supported"):
        load_model_spec(other, "float32")


def test_no_pooling_in_the_file_needs_pooler_config(files):
    """bert.pooling_type NONE (a vector per token, llama.cpp's default when absent): refused, naming the key and
    the flag; --pooler-config chooses one, and gives that pooling's vectors."""
    from cpuinfer import LLM

    none = rewrite_tensors(files["f32"], str(files["dir"] / "none.gguf"), fields={"bert.pooling_type": None})
    with pytest.raises(ValueError, match=r"none.gguf: bert.pooling_type .*--pooler-config"):
        LLM(none, dtype="float32", block_size=16)
    got = embed(none, "float32", pooler_config={"pooling_type": "MEAN"})
    torch.testing.assert_close(got, embed(files["f32"], "float32"), atol=1e-6, rtol=0)


# llama.cpp's token ids and embeddings (its pooling, L2-normalised) of texts, through llama-cpp-python's Llama, in
# the interpreter that has it (CPUINFER_LLAMA_PYTHON, else this one).
LLAMA_EMBED = r"""
import json, sys
from llama_cpp import Llama
path, texts = sys.argv[1], json.loads(sys.argv[2])
llm = Llama(path, embedding=True, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=2, n_threads_batch=2, verbose=False)
ids = [llm.tokenize(t.encode(), add_bos=True, special=False) for t in texts]
print(json.dumps({"ids": ids, "vectors": llm.embed(texts, normalize=True)}))
"""


def test_close_to_llama_cpps_own(files):
    """The same files run by llama.cpp: its token ids are ours, and its vectors close to ours for the f32 file
    (float32 run), the Q8_0 file and a Q4_K_M file from llama.cpp's own quantizer (bfloat16 runs, packed).
    Skipped where no interpreter imports llama_cpp (CI does not build it: CPUINFER_LLAMA_PYTHON)."""
    import json
    import subprocess

    py = llama_python()
    if py is None:
        pytest.skip("llama-cpp-python is not installed (CPUINFER_LLAMA_PYTHON: an interpreter that has it)")
    q4 = llama_quantize(py, files["f32"], str(files["dir"] / "bert.q4_k_m.gguf"))
    tokenizer = load_model_spec(files["f32"], "float32").tokenizer
    # Measured (Sapphire Rapids, amx): f32 max |difference| 7.7e-5 of unit vectors (cosine 1.000000; llama.cpp's GELU
    # table and summation order); Q8_0 min cosine 0.99988, Q4_K_M 0.99976 (int8 activations, rounded differently).
    for file, dtype, bound in (
        (files["f32"], "float32", 0.9999),
        (files["q8_0"], "bfloat16", 0.999),
        (q4, "bfloat16", 0.999),
    ):
        out = subprocess.run([py, "-c", LLAMA_EMBED, file, json.dumps(TEXTS)], capture_output=True, timeout=600)
        assert out.returncode == 0, out.stderr.decode()[-3000:]
        theirs = json.loads(out.stdout)
        assert theirs["ids"] == [tokenizer.encode(t).ids for t in TEXTS]
        ours, theirs = embed(file, dtype), torch.tensor(theirs["vectors"])
        cos = torch.nn.functional.cosine_similarity(ours, theirs, dim=-1)
        err = (ours - theirs).abs().max().item()
        print(f"{os.path.basename(file)} {dtype}: min cosine {cos.min():.6f}, max |difference| {err:.2e} to llama.cpp")
        assert cos.min() >= bound, (file, cos)
        if dtype == "float32":
            assert err < 5e-4, err
