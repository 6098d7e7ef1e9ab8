"""`cpuinfer serve` with a cross-encoder and with an embedding model: /score, /rerank (Jina's and Cohere's shape) and
/classify through plain HTTP, against sentence-transformers' CrossEncoder and cosine similarity; bad input, too many
or too long documents and the wrong model kind are 400s naming the problem; the inputs are counted on /metrics."""

from __future__ import annotations

import httpx
import pytest
import torch

from ..server.conftest import running_server
from .test_bert import minilm_dir, st_encode
from .test_cross_encoder import DOCS, QUERIES, predict
from .tiny_encoders import make_bert_classifier

pytest.importorskip("sentence_transformers")


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    return make_bert_classifier(tmp_path_factory.mktemp("bert-ce-api"), minilm_dir())


@pytest.fixture(scope="module")
def reranker(reranker_dir):
    with running_server(str(reranker_dir), "--dtype", "float32", "--block-size", "16") as s:
        yield s


@pytest.fixture(scope="module")
def embedder():
    with running_server(minilm_dir(), "--dtype", "float32", "--block-size", "16", "--max-model-len", "256") as s:
        yield s


def post(server, route: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + route, json=body, headers=server.headers(), timeout=60)


def ok(server, route: str, body: dict) -> dict:
    r = post(server, route, body)
    assert r.status_code == 200, r.text
    return r.json()


def test_score_one_to_n_and_pairwise(reranker, reranker_dir):
    for route in ("/score", "/v1/score"):
        got = ok(reranker, route, {"text_1": QUERIES[0], "text_2": DOCS})
        assert [d["index"] for d in got["data"]] == [0, 1, 2] and got["data"][0]["object"] == "score"
        ref = predict(reranker_dir, [(QUERIES[0], d) for d in DOCS])
        torch.testing.assert_close(torch.tensor([d["score"] for d in got["data"]]), ref, atol=1e-5, rtol=0)
    got = ok(reranker, "/score", {"text_1": QUERIES, "text_2": DOCS[:2]})
    ref = predict(reranker_dir, list(zip(QUERIES, DOCS[:2], strict=True)))
    torch.testing.assert_close(torch.tensor([d["score"] for d in got["data"]]), ref, atol=1e-5, rtol=0)
    assert got["usage"]["prompt_tokens"] == got["usage"]["total_tokens"] > 0


def test_rerank_sorted_top_n_and_documents(reranker, reranker_dir):
    ref = predict(reranker_dir, [(QUERIES[1], d) for d in DOCS])
    order = sorted(range(len(DOCS)), key=lambda i: -float(ref[i]))
    for route in ("/rerank", "/v1/rerank", "/v2/rerank"):
        got = ok(reranker, route, {"query": QUERIES[1], "documents": DOCS})
        assert [r["index"] for r in got["results"]] == order
        assert [r["document"]["text"] for r in got["results"]] == [DOCS[i] for i in order]
        scores = torch.tensor([r["relevance_score"] for r in got["results"]])
        torch.testing.assert_close(scores, ref[order], atol=1e-5, rtol=0)
        assert got["usage"]["total_tokens"] > 0
    top = ok(reranker, "/rerank", {"query": QUERIES[1], "documents": DOCS, "top_n": 2, "return_documents": False})
    assert [r["index"] for r in top["results"]] == order[:2] and all(r["document"] is None for r in top["results"])


def test_truncation_and_activation(reranker, reranker_dir):
    """truncate_prompt_tokens truncates each pair longest-first, as CrossEncoder(max_length=k) does; activation false
    gives the raw logit (whose sigmoid is the score)."""
    from sentence_transformers import CrossEncoder

    long_doc = "retrieval on cpus " * 200  # over the 512-token context
    r = post(reranker, "/score", {"text_1": QUERIES[0], "text_2": long_doc})
    assert r.status_code == 400 and "maximum context length is 512" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "text_2"
    got = ok(reranker, "/score", {"text_1": QUERIES[0], "text_2": [long_doc, DOCS[0]], "truncate_prompt_tokens": 40})
    ce = CrossEncoder(str(reranker_dir), device="cpu", max_length=40)
    ref = torch.tensor([float(ce.predict([(QUERIES[0], d)])[0]) for d in (long_doc, DOCS[0])])
    torch.testing.assert_close(torch.tensor([d["score"] for d in got["data"]]), ref, atol=1e-5, rtol=0)
    raw = ok(reranker, "/score", {"text_1": QUERIES[0], "text_2": DOCS, "activation": False})
    logits = torch.tensor([d["score"] for d in raw["data"]])
    torch.testing.assert_close(
        logits.sigmoid(), predict(reranker_dir, [(QUERIES[0], d) for d in DOCS]), atol=1e-5, rtol=0
    )


def test_classify(reranker, reranker_dir):
    got = ok(reranker, "/classify", {"input": DOCS})
    assert [d["num_classes"] for d in got["data"]] == [1, 1, 1] and got["data"][0]["label"] == "LABEL_0"
    # A text classified alone: the classifier's sigmoid over transformers' logit of that text.
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(reranker_dir))
    model = transformers.BertForSequenceClassification.from_pretrained(str(reranker_dir)).float().eval()
    with torch.inference_mode():
        ref = torch.cat([model(**tok(d, return_tensors="pt")).logits[:, 0] for d in DOCS]).sigmoid()
    torch.testing.assert_close(torch.tensor([d["probs"][0] for d in got["data"]]), ref, atol=1e-5, rtol=0)
    one = ok(reranker, "/v1/classify", {"input": DOCS[0]})["data"][0]["probs"]  # alone: the same within rounding
    torch.testing.assert_close(torch.tensor(one), torch.tensor(got["data"][0]["probs"]), atol=1e-6, rtol=0)


def test_bad_requests_are_400(reranker):
    cases = [
        ("/rerank", {"query": "q", "documents": []}, "documents is empty"),
        ("/rerank", {"query": "q", "documents": ["a"] * 2049}, "at most 2048"),
        ("/rerank", {"query": "", "documents": ["a"]}, "empty string"),
        ("/rerank", {"query": "q", "documents": ["a", " "]}, "empty string"),
        ("/rerank", {"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "as many as"),
        ("/score", {"text_1": "a", "text_2": []}, "text_2 is empty"),
        ("/score", {"text_1": "a", "text_2": "b", "truncate_prompt_tokens": 2}, "no room"),
        ("/classify", {"input": []}, "input is empty"),
        ("/classify", {"input": ""}, "empty string"),
        ("/score", {"text_1": "x" * 1_000_000, "text_2": "b"}, "characters"),
        ("/v1/embeddings", {"input": "a"}, "cannot embed"),
        ("/v1/completions", {"prompt": "a", "max_tokens": 2}, "pooling runner"),
    ]
    for route, body, words in cases:
        r = post(reranker, route, body)
        assert r.status_code == 400, (route, body, r.text)
        err = r.json()["error"]
        assert words in err["message"] or words == err.get("param"), (route, body, r.text)
    r = post(reranker, "/rerank", {"query": "q", "documents": ["retrieval"] * 1100})  # over --max-request-sequences
    assert r.status_code == 400 and "--max-request-sequences" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "documents"


def test_scored_inputs_are_counted_on_metrics(reranker):
    def count(task: str) -> float:
        text = httpx.get(reranker.url + "/metrics", headers=reranker.headers(), timeout=10).text
        lines = [
            x for x in text.splitlines() if x.startswith("cpuinfer:pooling_inputs_total{") and f'task="{task}"' in x
        ]
        return float(lines[0].rsplit(" ", 1)[1]) if lines else 0.0

    before = count("score"), count("classify")
    ok(reranker, "/rerank", {"query": "q", "documents": DOCS})
    ok(reranker, "/classify", {"input": DOCS[:2]})
    assert (count("score") - before[0], count("classify") - before[1]) == (3, 2)


def test_embedding_model_scores_by_cosine_similarity(embedder):
    """As vLLM: /score and /rerank on an embedding model are the cosine similarity of the texts' embeddings;
    /classify is refused, naming what the model serves."""
    from sentence_transformers import util

    path = minilm_dir()
    ref = util.cos_sim(st_encode(path, QUERIES[:1]), st_encode(path, DOCS))[0]
    got = ok(embedder, "/score", {"text_1": QUERIES[0], "text_2": DOCS})
    torch.testing.assert_close(torch.tensor([d["score"] for d in got["data"]]), ref, atol=1e-5, rtol=0)
    ranked = ok(embedder, "/rerank", {"query": QUERIES[0], "documents": DOCS, "top_n": 1})["results"]
    assert len(ranked) == 1 and ranked[0]["index"] == int(ref.argmax())
    r = post(embedder, "/classify", {"input": DOCS})
    assert r.status_code == 400 and "embeddings" in r.json()["error"]["message"], r.text
