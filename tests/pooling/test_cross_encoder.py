"""Cross-encoders (`BertForSequenceClassification`, `XLMRobertaForSequenceClassification`: bge-reranker's form)
through LLM.score and LLM.classify, against sentence-transformers' CrossEncoder.predict and transformers' logits
on tiny random checkpoints made here: float32 within 1e-5, bf16 within 2e-2 of the probability."""

from __future__ import annotations

import pytest
import torch

from cpuinfer import LLM
from cpuinfer.errors import InvalidRequestError
from cpuinfer.sampling_params import PoolingParams

from .test_bert import minilm_dir, st_encode
from .tiny_encoders import TEXTS as WORD_TEXTS
from .tiny_encoders import make_bert_classifier, make_xlmr

pytest.importorskip("sentence_transformers")
transformers = pytest.importorskip("transformers")

QUERIES = ["what is the capital of france", "how do cpus multiply matrices"]
DOCS = [
    "Paris is the capital and largest city of France.",
    "AMX tiles multiply bf16 matrices inside the core. " * 3,
    "hello",
]


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")


@pytest.fixture(scope="module")
def bert_reranker(tmp_path_factory):
    return make_bert_classifier(tmp_path_factory.mktemp("bert-ce"), minilm_dir())


@pytest.fixture(scope="module")
def xlmr_reranker(tmp_path_factory):
    return make_xlmr(tmp_path_factory.mktemp("xlmr-ce"), "XLMRobertaForSequenceClassification", num_labels=1)


def predict(path, pairs) -> torch.Tensor:
    """CrossEncoder.predict, one pair per batch (no padding involved)."""
    from sentence_transformers import CrossEncoder

    model = CrossEncoder(str(path), device="cpu")
    return torch.tensor([float(model.predict([p])[0]) for p in pairs])


def hf_logits(path, cls, pairs) -> torch.Tensor:
    """transformers' own logits of each pair (its tokenizer's pair encoding, token types included)."""
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = getattr(transformers, cls).from_pretrained(str(path)).float().eval()
    with torch.inference_mode():
        return torch.cat([model(**tok(a, b, return_tensors="pt")).logits for a, b in pairs])


def scores(outs) -> torch.Tensor:
    return torch.tensor([o.outputs.score for o in outs])


@pytest.mark.parametrize("which", ["bert", "xlmr"])
def test_scores_equal_cross_encoder_predict(which, bert_reranker, xlmr_reranker):
    """1:N and N:N pairs: LLM.score equals CrossEncoder.predict (sigmoid of the one logit); without the activation
    it is transformers' logit; bf16 within 2e-2."""
    path = bert_reranker if which == "bert" else xlmr_reranker
    texts = (QUERIES, DOCS) if which == "bert" else (WORD_TEXTS[:2], WORD_TEXTS[2:])
    cls = "BertForSequenceClassification" if which == "bert" else "XLMRobertaForSequenceClassification"
    one_to_n = [(texts[0][0], d) for d in texts[1]]
    pairwise = list(zip(texts[0], texts[1][:2], strict=True))
    llm = LLM(str(path), dtype="float32", block_size=16)
    assert llm.llm_engine.config.runner == "pooling"
    torch.testing.assert_close(
        scores(llm.score(texts[0][0], texts[1], use_tqdm=False)), predict(path, one_to_n), atol=1e-5, rtol=0
    )
    torch.testing.assert_close(
        scores(llm.score(texts[0], texts[1][:2], use_tqdm=False)), predict(path, pairwise), atol=1e-5, rtol=0
    )
    raw = llm.score(texts[0][0], texts[1], use_tqdm=False, pooling_params=PoolingParams(activation=False))
    torch.testing.assert_close(scores(raw), hf_logits(path, cls, one_to_n)[:, 0], atol=1e-5, rtol=0)
    bf16 = LLM(str(path), dtype="bfloat16", block_size=16)
    got = scores(bf16.score(texts[0][0], texts[1], use_tqdm=False))
    assert (got - predict(path, one_to_n)).abs().max() <= 2e-2


def test_classify_several_labels(tmp_path):
    """A 3-label BERT classifier: LLM.classify's probs are the softmax of transformers' logits; score needs one
    label and says so."""
    path = make_bert_classifier(tmp_path, minilm_dir(), num_labels=3)
    llm = LLM(str(path), dtype="float32", block_size=16)
    got = torch.tensor([o.outputs.probs for o in llm.classify(DOCS, use_tqdm=False)])
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.BertForSequenceClassification.from_pretrained(str(path)).float().eval()
    with torch.inference_mode():
        ref = torch.cat([model(**tok(d, return_tensors="pt")).logits for d in DOCS]).softmax(-1)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    with pytest.raises(InvalidRequestError, match="3 labels"):
        llm.score(QUERIES[0], DOCS, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="cannot embed"):
        llm.embed(DOCS, use_tqdm=False)


def test_score_on_an_embedding_model_is_cosine_similarity():
    """As vLLM: LLM.score on an embedding model is the cosine similarity of the two texts' embeddings; classify is
    refused naming what the model serves."""
    from sentence_transformers import util

    path = minilm_dir()
    llm = LLM(path, dtype="float32", block_size=16)
    ref = util.cos_sim(st_encode(path, QUERIES[:1]), st_encode(path, DOCS))[0]
    torch.testing.assert_close(scores(llm.score(QUERIES[0], DOCS, use_tqdm=False)), ref, atol=1e-5, rtol=0)
    with pytest.raises(InvalidRequestError, match=r"cannot classify.*embeddings"):
        llm.classify(DOCS, use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="as many as"):
        llm.score(QUERIES, DOCS, use_tqdm=False)


def test_pair_truncation_is_transformers_longest_first():
    """encode_pairs(max_length=k) keeps the tokens transformers' tokenizer(a, b, truncation=True, max_length=k)
    keeps, token types included, over random lengths on both sides of every case (one text cut, both halved)."""
    import random

    from tokenizers import Tokenizer

    from cpuinfer.entrypoints.score_inputs import encode_pairs

    path = minilm_dir()
    hf = transformers.AutoTokenizer.from_pretrained(path)
    tok = Tokenizer.from_file(f"{path}/tokenizer.json")
    tok.no_padding()
    tok.no_truncation()
    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "ran", "far", "away", "from", "home"]
    for _ in range(200):
        a, b = (" ".join(rng.choices(words, k=rng.randint(1, 30))) for _ in range(2))
        k = rng.randint(5, 50)
        ref = hf(a, b, truncation=True, max_length=k)
        assert encode_pairs(tok, [(a, b)], 2, k) == [(ref["input_ids"], ref["token_type_ids"])], (a, b, k)
