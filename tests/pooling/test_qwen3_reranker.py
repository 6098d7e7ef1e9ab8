"""Qwen3-Reranker in vLLM's form: a Qwen3 causal LM served with hf_overrides as Qwen3ForSequenceClassification,
scored by its last token's label-token logits (classifier_from_token). Against transformers' own logits of the
causal LM on a tiny random checkpoint: the score is softmax over the (no, yes) logits' yes, float32 within 1e-5;
a transformers Qwen3ForSequenceClassification checkpoint (score.weight) scores as transformers does."""

from __future__ import annotations

import json

import pytest
import torch

from cpuinfer import LLM

from .tiny_embedders import TEXTS, make_qwen3

transformers = pytest.importorskip("transformers")

# The tiny vocabulary has no "no"/"yes": two of its words play them (vLLM resolves any tokens the same way).
NO, YES = "w3", "w7"
OVERRIDES = {
    "architectures": ["Qwen3ForSequenceClassification"],
    "classifier_from_token": [NO, YES],
    "is_original_qwen3_reranker": True,
}


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "0.1")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "lm_head"])
def reranker(tmp_path_factory, request):
    """Qwen3-Reranker-0.6B ties its head to the embeddings; the larger ones keep an lm_head."""
    return make_qwen3(tmp_path_factory.mktemp("qwen3-reranker"), tie_word_embeddings=request.param)


def last_logits(path, pairs) -> torch.Tensor:
    """transformers' causal-LM logits at the last position of each pair as its tokenizer joins them."""
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    model = transformers.Qwen3ForCausalLM.from_pretrained(str(path)).float().eval()
    with torch.inference_mode():
        return torch.stack([model(**tok(a, b, return_tensors="pt")).logits[0, -1] for a, b in pairs])


def test_original_reranker_scores_are_the_yes_probability(reranker):
    tok = transformers.AutoTokenizer.from_pretrained(str(reranker))
    no, yes = tok.convert_tokens_to_ids([NO, YES])
    pairs = [(TEXTS[0], d) for d in TEXTS[1:]]
    ref = last_logits(reranker, pairs)[:, [no, yes]].softmax(-1)[:, 1]
    llm = LLM(str(reranker), dtype="float32", block_size=16, hf_overrides=OVERRIDES)
    assert llm.llm_engine.config.runner == "pooling"  # a sequence classifier: never generates
    got = torch.tensor([o.outputs.score for o in llm.score(TEXTS[0], TEXTS[1:], use_tqdm=False)])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    # The CLI's spelling, as JSON; bf16 within 2e-2.
    bf16 = LLM(str(reranker), dtype="bfloat16", block_size=16, hf_overrides=json.dumps(OVERRIDES))
    got = torch.tensor([o.outputs.score for o in bf16.score(TEXTS[0], TEXTS[1:], use_tqdm=False)])
    assert (got - ref).abs().max() <= 2e-2


def test_no_post_processing_classifies_over_the_label_tokens(reranker):
    """method no_post_processing: one label per token, their logits' softmax (LLM.classify)."""
    tok = transformers.AutoTokenizer.from_pretrained(str(reranker))
    ids = tok.convert_tokens_to_ids([NO, YES])
    tok_pairs = [(t, "") for t in TEXTS]
    over = {**OVERRIDES, "is_original_qwen3_reranker": False, "method": "no_post_processing"}
    llm = LLM(str(reranker), dtype="float32", block_size=16, hf_overrides=over)
    got = torch.tensor([o.outputs.probs for o in llm.classify(TEXTS, use_tqdm=False)])
    model = transformers.Qwen3ForCausalLM.from_pretrained(str(reranker)).float().eval()
    with torch.inference_mode():
        ref = torch.stack([model(**tok(a, return_tensors="pt")).logits[0, -1, ids] for a, _ in tok_pairs])
    torch.testing.assert_close(got, ref.softmax(-1), atol=1e-5, rtol=0)


def test_sequence_classification_checkpoint(tmp_path):
    """A checkpoint saved as transformers' Qwen3ForSequenceClassification (score.weight, one label)."""
    path = make_qwen3(tmp_path)
    cfg = transformers.AutoConfig.from_pretrained(str(path))
    cfg.num_labels = 1
    torch.manual_seed(5)
    model = transformers.Qwen3ForSequenceClassification(cfg).float().eval()
    model.save_pretrained(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    pairs = [(TEXTS[1], d) for d in TEXTS]
    with torch.inference_mode():
        ref = torch.cat([model(**tok(a, b, return_tensors="pt")).logits[:, 0] for a, b in pairs]).sigmoid()
    llm = LLM(str(path), dtype="float32", block_size=16)
    got = torch.tensor([o.outputs.score for o in llm.score(TEXTS[1], TEXTS, use_tqdm=False)])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match="sequence classifier"):
        LLM(str(path), runner="generate")


def test_served_with_hf_overrides(tmp_path):
    """`cpuinfer serve --hf-overrides '{...}'` (vLLM's flag, JSON): /rerank ranks by transformers' yes-probability."""
    import httpx

    from ..server.conftest import running_server

    path = make_qwen3(tmp_path)
    tok = transformers.AutoTokenizer.from_pretrained(str(path))
    no, yes = tok.convert_tokens_to_ids([NO, YES])
    ref = last_logits(path, [(TEXTS[0], d) for d in TEXTS[1:]])[:, [no, yes]].softmax(-1)[:, 1]
    with running_server(
        str(path), "--dtype", "float32", "--block-size", "16", "--hf-overrides", json.dumps(OVERRIDES)
    ) as s:
        r = httpx.post(s.url + "/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:]}, headers=s.headers())
        assert r.status_code == 200, r.text
        results = r.json()["results"]
    assert [x["index"] for x in results] == ref.argsort(descending=True).tolist()
    got = torch.tensor([x["relevance_score"] for x in sorted(results, key=lambda x: x["index"])])
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
