"""Request fields clients send by default (issue 33): accepted-and-logged when they do not change the output,
implemented when they do (logit_bias, reasoning_effort, the `schema` spelling of response_format), and
every 4xx logged with its request id and reason. Through the official `openai` client and httpx."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from .conftest import running_server

MODEL = "SmolLM2-135M-Instruct"
ASK = [{"role": "user", "content": "Name a colour."}]


@pytest.fixture(scope="module")
def server():
    """The module's server: test_reasoning_effort_reaches_the_chat_template sends its own chat template."""
    with running_server("--trust-request-chat-template") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0, timeout=120)


def post(server, path: str, body: dict, **headers) -> httpx.Response:
    return httpx.post(server.v1 + path, json=body, headers={**server.headers(), **headers}, timeout=120)


def test_fields_that_do_not_change_the_output_are_accepted_logged_once_and_ignored(server, client):
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0)
    extras = {
        "store": True,
        "metadata": {"team": "a"},
        "service_tier": "auto",
        "user": "u-1",
        "prediction": {"type": "content", "content": "Blue"},
    }
    for _ in range(2):
        r = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=6, temperature=0, **extras)
        assert r.choices[0].message.content == plain.choices[0].message.content
    c = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2, extra_body={"store": False})
    assert c.choices[0].text is not None
    log = server.log()
    for name in ("store", "metadata", "service_tier"):
        lines = [line for line in log.splitlines() if f"request field '{name}' is accepted and ignored" in line]
        assert len(lines) == 1, (name, lines)
        assert "WARNING" in lines[0]
    # prediction is not ignored: it feeds the speculative proposer (tests/server/test_spec_decode_server.py).
    assert "request field 'prediction'" not in log


def output_ids(server, body: dict) -> list[int]:
    r = post(server, "/completions", {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, **body})
    assert r.status_code == 200, r.text
    text = r.json()["choices"][0]["text"]
    body = {"prompt": text, "add_special_tokens": False}
    return httpx.post(server.url + "/tokenize", json=body, headers=server.headers()).json()["tokens"]


def test_logit_bias_bans_and_forces_tokens(server, client):
    ids = output_ids(server, {})
    banned = output_ids(server, {"logit_bias": {str(ids[0]): -100}})
    assert banned[0] != ids[0]
    forced = 1234
    got = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=3, temperature=0, logit_bias={str(forced): 100}
    )
    want = httpx.post(server.url + "/detokenize", json={"tokens": [forced] * 3}, headers=server.headers()).json()
    assert got.choices[0].text == want["prompt"]
    chat = client.chat.completions.create(
        model=MODEL, messages=ASK, max_tokens=3, temperature=0.8, seed=1, logit_bias={str(forced): 100}
    )
    assert chat.choices[0].message.content == want["prompt"]


@pytest.mark.parametrize(
    "bias, fragment",
    [
        ({"99999999": 1}, "outside the vocabulary"),
        ({"abc": 1}, "token ids"),
        ({"12": 101}, "logit_bias"),
    ],
)
def test_bad_logit_bias_is_a_400_naming_it(server, bias, fragment):
    r = post(server, "/chat/completions", {"messages": ASK, "max_tokens": 2, "logit_bias": bias})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"].startswith("logit_bias") and fragment in r.json()["error"]["message"]


def test_reasoning_effort_reaches_the_chat_template(server, client):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %} effort={{ reasoning_effort }}"
    counts = {}
    for effort in ("low", "high"):
        r = client.chat.completions.create(
            model=MODEL,
            messages=ASK,
            max_tokens=1,
            reasoning_effort=effort,
            extra_body={"chat_template": template},
        )
        counts[effort] = r.usage.prompt_tokens
    want = {
        e: len(
            httpx.post(
                server.url + "/tokenize",
                json={"prompt": f"Name a colour. effort={e}", "add_special_tokens": False},
                headers=server.headers(),
            ).json()["tokens"]
        )
        for e in ("low", "high")
    }
    assert counts == want


def test_reasoning_effort_is_a_template_variable_unless_the_request_sets_it():
    from cpuinfer.entrypoints.openai.protocol import ChatCompletionRequest

    r = ChatCompletionRequest.model_validate({"messages": ASK, "reasoning_effort": "low"})
    assert r.chat_template_kwargs == {"reasoning_effort": "low"}
    r = ChatCompletionRequest.model_validate(
        {"messages": ASK, "reasoning_effort": "low", "chat_template_kwargs": {"reasoning_effort": "high", "x": 1}}
    )
    assert r.chat_template_kwargs == {"reasoning_effort": "high", "x": 1}


def test_instructor_json_schema_mode_top_level_schema(server):
    # instructor 1.3's Mode.JSON_SCHEMA sends the schema at the top level of response_format.
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    body = {"messages": ASK, "max_tokens": 40, "response_format": {"type": "json_schema", "schema": schema}}
    r = post(server, "/chat/completions", body)
    assert r.status_code == 200, r.text
    out = json.loads(r.json()["choices"][0]["message"]["content"])
    assert set(out) == {"name", "age"} and isinstance(out["age"], int)
    both = {"type": "json_schema", "schema": schema, "json_schema": {"name": "x", "schema": schema}}
    assert post(server, "/chat/completions", {**body, "response_format": both}).status_code == 400


def test_every_4xx_is_logged_with_its_request_id_and_reason(server):
    r = post(server, "/chat/completions", {"messages": ASK, "functions": []}, **{"X-Request-Id": "trace-42"})
    assert r.status_code == 400 and r.headers["x-request-id"] == "trace-42"
    r2 = httpx.post(server.v1 + "/chat/completions", json={"messages": ASK})  # no API key
    assert r2.status_code == 401
    logged_id = r2.headers["x-request-id"]
    log = server.log()
    line = r"INFO .*400 POST /v1/chat/completions from 127\.0\.0\.1 \(request id trace-42\): 'functions'"
    assert re.search(line, log)
    assert f"401 POST /v1/chat/completions from 127.0.0.1 (request id {logged_id}): Unauthorized" in log


def test_echo_with_logprobs_scores_the_prompt(server, client):
    """OpenAI's legacy scoring (lm-eval's loglikelihood): echo, logprobs, max_tokens 1."""
    prompt = "The capital of France is Paris"
    ids = httpx.post(server.url + "/tokenize", json={"prompt": prompt}, headers=server.headers()).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=1, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text.startswith(prompt)
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x is not None and x <= 0 for x in lp.token_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert "".join(lp.tokens[: len(ids)]) == prompt
    # The prompt's last token scored alone, as the greedy continuation of the prompt before it.
    shorter = client.completions.create(model=MODEL, prompt=ids[:-1], max_tokens=1, temperature=0, logprobs=2)
    if shorter.choices[0].logprobs.tokens[0] == lp.tokens[len(ids) - 1]:
        assert abs(shorter.choices[0].logprobs.token_logprobs[0] - lp.token_logprobs[len(ids) - 1]) < 0.15
    streamed = client.completions.create(
        model=MODEL, prompt=prompt, echo=True, logprobs=2, max_tokens=1, temperature=0, stream=True
    )
    tokens, text = [], ""
    for chunk in streamed:
        for c in chunk.choices:
            text += c.text
            tokens += c.logprobs.tokens if c.logprobs else []
    assert text == r.choices[0].text and tokens == lp.tokens


def test_vllm_prompt_logprobs_field(server):
    body = {"prompt": "Hello there, friend", "max_tokens": 1, "prompt_logprobs": 1}
    r = post(server, "/completions", body)
    assert r.status_code == 200, r.text
    plp = r.json()["choices"][0]["prompt_logprobs"]
    ids = httpx.post(server.url + "/tokenize", json={"prompt": body["prompt"]}, headers=server.headers()).json()
    assert len(plp) == ids["count"] and plp[0] is None
    for tok, entry in zip(ids["tokens"][1:], plp[1:], strict=True):
        assert str(tok) in entry and {"logprob", "rank", "decoded_token"} <= entry[str(tok)].keys()
    too_many = post(server, "/completions", {**body, "prompt_logprobs": 21})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "prompt_logprobs"


def test_chat_prompt_logprobs(server):
    body = {"messages": ASK, "max_tokens": 1, "prompt_logprobs": 0}
    r = post(server, "/chat/completions", body)
    assert r.status_code == 200, r.text
    ids = httpx.post(server.url + "/tokenize", json={"messages": ASK}, headers=server.headers()).json()["tokens"]
    plp = r.json()["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    assert [list(e) for e in plp[1:]] == [[str(t)] for t in ids[1:]]  # k = 0: the prompt's own token only
    streamed = post(server, "/chat/completions", {**body, "stream": True})
    assert streamed.status_code == 400 and "stream" in streamed.json()["error"]["message"]
