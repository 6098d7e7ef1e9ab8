"""The server through the official `openai` client, against the engine's own LLM.generate.

One real `cpuinfer serve` (bundled SmolLM2) for the module; every answer is
checked against an independent reference: LLM.generate in this process for
text, the transformers tokenizer for chat formatting, the server's own
/tokenize for counts.
"""

from __future__ import annotations

import json
import math
import os

import httpx
import openai
import pytest

from .conftest import MAX_MODEL_LEN, metric

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village, there"]
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    """The official client, pointed at the test server."""
    return openai.OpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm():
    """The engine's offline API on the same model and context length (the text reference)."""
    from cpuinfer import LLM

    old = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = "0.5"
    try:
        yield LLM(max_model_len=MAX_MODEL_LEN)
    finally:
        if old is None:
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = old


def greedy(llm, prompt: str, max_tokens: int = MAX_TOKENS):
    """LLM.generate's greedy output for one prompt."""
    from cpuinfer import SamplingParams

    return llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=max_tokens))[0].outputs[0]


def hf_chat_prompt(messages: list[dict]) -> str:
    """The chat prompt as transformers renders the model's own template (independent of the server)."""
    from transformers import AutoTokenizer

    from cpuinfer.config import default_model_path

    path = default_model_path()
    tok = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path))
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def tokenize(server, text: str) -> list[int]:
    """Token ids of `text` from the server's /tokenize."""
    r = httpx.post(server.url + "/tokenize", json={"prompt": text}, headers=server.headers(), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ---- happy paths --------------------------------------------------------------------------------


def test_models_lists_the_served_model(client, model_name):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]


@pytest.mark.parametrize("prompt", PROMPTS)
def test_completion_greedy_equals_llm_generate(client, model_name, llm, server, prompt):
    ref = greedy(llm, prompt)
    out = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(tokenize(server, prompt))
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_stream_matches_non_stream(client, model_name):
    prompt = PROMPTS[0]
    full = client.completions.create(model=model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    chunks = list(
        client.completions.create(
            model=model_name,
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == full.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_batch_of_prompts(client, model_name, llm):
    out = client.completions.create(model=model_name, prompt=PROMPTS[:2], max_tokens=8, temperature=0)
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [greedy(llm, p, 8).text for p in PROMPTS[:2]]


def test_completion_echo(client, model_name, llm):
    out = client.completions.create(model=model_name, prompt=PROMPTS[1], max_tokens=8, temperature=0, echo=True)
    assert out.choices[0].text == PROMPTS[1] + greedy(llm, PROMPTS[1], 8).text


def test_chat_greedy_equals_llm_generate_on_the_template(client, model_name, llm):
    messages = [
        {"role": "system", "content": "You are a terse assistant."},
        {"role": "user", "content": "Name a primary color."},
    ]
    ref = greedy(llm, hf_chat_prompt(messages))
    out = client.chat.completions.create(model=model_name, messages=messages, max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.choices[0].finish_reason == ref.finish_reason


def test_chat_multi_turn_and_stream(client, model_name):
    messages = [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Now say goodbye."},
    ]
    full = client.chat.completions.create(
        model=model_name, messages=messages, max_completion_tokens=MAX_TOKENS, temperature=0
    )
    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=messages,
            max_completion_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_n_choices_and_usage(client, model_name):
    out = client.completions.create(model=model_name, prompt=PROMPTS[2], max_tokens=8, temperature=1.0, n=3, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    # The same seed gives the same choices again; the choices themselves differ from each other (sampling).
    again = client.completions.create(model=model_name, prompt=PROMPTS[2], max_tokens=8, temperature=1.0, n=3, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    assert len({c.text for c in out.choices}) > 1

    chunks = list(
        client.chat.completions.create(
            model=model_name,
            messages=[{"role": "user", "content": "Tell me a word."}],
            max_tokens=6,
            n=2,
            temperature=1.0,
            seed=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    seen = {c.choices[0].index for c in chunks if c.choices}
    assert seen == {0, 1}
    finishes = [c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason]
    assert sorted(finishes) == [0, 1]
    assert chunks[-1].usage.completion_tokens >= 2


def test_n_choices_count_tokens(client, model_name):
    out = client.completions.create(
        model=model_name,
        prompt=PROMPTS[0],
        max_tokens=5,
        temperature=1.0,
        n=2,
        seed=1,
        logprobs=0,
        extra_body={"ignore_eos": True},
    )
    assert out.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in out.choices) == 10


def test_stop_string_cuts_the_greedy_text(client, model_name, llm):
    prompt = PROMPTS[2]
    ref = greedy(llm, prompt, 16).text
    words = [w for w in ref.split() if len(w) >= 3]
    assert words, f"reference has no word to stop at: {ref!r}"
    stop = words[len(words) // 2]
    out = client.completions.create(model=model_name, prompt=prompt, max_tokens=16, temperature=0, stop=[stop])
    choice = out.choices[0]
    assert choice.text == ref[: ref.index(stop)]
    assert choice.finish_reason == "stop"
    assert choice.model_extra.get("stop_reason") == stop


def test_completion_logprobs(client, model_name, llm):
    prompt = PROMPTS[0]
    out = client.completions.create(model=model_name, prompt=prompt, max_tokens=8, temperature=0, logprobs=3)
    lp = out.choices[0].logprobs
    assert "".join(lp.tokens) == out.choices[0].text == greedy(llm, prompt, 8).text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 8
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen <= 0 and tok in top and 1 <= len(top) <= 4
        # Greedy picks the most likely token, so its logprob is the best of the top ones.
        assert math.isclose(chosen, max(top.values()), abs_tol=1e-4)
        assert sum(math.exp(v) for v in top.values()) <= 1.0 + 1e-3
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]


def test_chat_logprobs(client, model_name):
    out = client.chat.completions.create(
        model=model_name,
        messages=[{"role": "user", "content": "Count to three."}],
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    assert "".join(c.token for c in content) == out.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2
        assert c.top_logprobs[0].token == c.token and math.isclose(c.top_logprobs[0].logprob, c.logprob, abs_tol=1e-4)
        assert c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert bytes(c.bytes).decode("utf-8", "replace") == c.token


def test_vllm_extras_are_honoured(client, model_name):
    out = client.completions.create(
        model=model_name,
        prompt=PROMPTS[0],
        max_tokens=6,
        temperature=0,
        extra_body={"min_tokens": 6, "ignore_eos": True, "top_k": 5, "repetition_penalty": 1.1},
    )
    assert out.usage.completion_tokens == 6 and out.choices[0].finish_reason == "length"


def test_tokenize_and_detokenize_round_trip(server):
    text = "Hello, world! Ünïcödé ✓"
    ids = tokenize(server, text)
    assert ids
    r = httpx.post(server.url + "/detokenize", json={"tokens": ids}, headers=server.headers(), timeout=30)
    assert r.status_code == 200 and r.json()["prompt"] == text
    r = httpx.post(
        server.url + "/tokenize",
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers=server.headers(),
        timeout=30,
    )
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == MAX_MODEL_LEN


def test_health_version_openapi(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    doc = httpx.get(server.url + "/openapi.json", headers=server.headers(), timeout=10).json()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize", "/health"):
        assert path in doc["paths"]


def test_token_counters_grow_while_a_long_request_runs(server, client, model_name):
    """vllm:prompt_tokens / generation_tokens count as the engine works (as vLLM's do), not at a request's end:
    during one non-streamed request of 2 prompts x 150 tokens, /metrics shows its prompts and part of its output
    before the answer comes; afterwards the totals are its usage."""
    import threading

    def counters() -> tuple[float, float]:
        text = httpx.get(server.url + "/metrics", headers=server.headers(), timeout=10).text
        return metric(text, "vllm:prompt_tokens_total"), metric(text, "vllm:generation_tokens_total")

    p0, g0 = counters()
    answer: list = []
    prompts = [PROMPTS[0], PROMPTS[1]]
    thread = threading.Thread(
        target=lambda: answer.append(
            client.completions.create(
                model=model_name, prompt=prompts, max_tokens=150, temperature=0, extra_body={"ignore_eos": True}
            )
        ),
        daemon=True,
    )
    thread.start()
    seen = None
    while thread.is_alive():
        p, g = counters()
        if g > g0 and thread.is_alive():
            seen = (p - p0, g - g0)
            break
        thread.join(0.05)
    thread.join(120)
    out = answer[0]
    assert seen is not None, "no token was counted before the request ended"
    assert 0 < seen[1] < 300 and seen[0] > 0, seen
    assert out.usage.completion_tokens == 300
    p, g = counters()
    assert (p - p0, g - g0) == (out.usage.prompt_tokens, 300)


def test_metrics_count_what_was_served(server, client, model_name):
    before = httpx.get(server.url + "/metrics", headers=server.headers(), timeout=10).text
    out = client.completions.create(
        model=model_name, prompt=PROMPTS[0], max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    after = httpx.get(server.url + "/metrics", headers=server.headers(), timeout=10).text
    assert (
        metric(after, "vllm:prompt_tokens_total") - metric(before, "vllm:prompt_tokens_total")
        == out.usage.prompt_tokens
    )
    assert metric(after, "vllm:generation_tokens_total") - metric(before, "vllm:generation_tokens_total") == 4
    assert (
        metric(after, "vllm:time_to_first_token_seconds_count")
        == metric(before, "vllm:time_to_first_token_seconds_count") + 1
    )
    assert (
        metric(after, "vllm:inter_token_latency_seconds_count")
        >= metric(before, "vllm:inter_token_latency_seconds_count") + 3
    )
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        "cpuinfer:kv_cache_blocks_free",
        "cpuinfer:kv_cache_blocks_total",
    ):
        metric(after, name)
    assert metric(after, "vllm:num_requests_running") == 0
    assert metric(after, "cpuinfer:kv_cache_blocks_free") == metric(after, "cpuinfer:kv_cache_blocks_total") > 0


# ---- bad input ----------------------------------------------------------------------------------


def post(server, path: str, body, headers=None, raw: bytes | None = None) -> httpx.Response:
    """POST with the API key unless `headers` says otherwise."""
    h = {"Content-Type": "application/json", **(server.headers() if headers is None else headers)}
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(server.url + path, content=content, headers=h, timeout=60)


def assert_error(r: httpx.Response, status: int, *needles: str, param: str | None = None) -> None:
    """An OpenAI-shaped error with this status whose message mentions every needle."""
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"}
    assert err["code"] == status
    for needle in needles:
        assert needle in err["message"], (needle, err["message"])
    if param is not None:
        assert err["param"] == param


def test_malformed_json(server):
    r = post(server, "/v1/completions", None, raw=b'{"prompt": "hi", ')
    assert_error(r, 400, "JSON")


@pytest.mark.parametrize(
    "body,needles,param",
    [
        ({"prompt": 12}, ["prompt"], "prompt"),
        ({"prompt": "hi", "max_tokens": "many"}, ["max_tokens"], "max_tokens"),
        ({"prompt": "hi", "temperature": -0.5}, ["temperature", "0"], "temperature"),
        ({"prompt": "hi", "top_p": 0}, ["top_p", "0"], "top_p"),
        ({"prompt": "hi", "top_p": 1.5}, ["top_p", "1"], "top_p"),
        ({"prompt": "hi", "n": 0}, ["n", "1"], "n"),
        ({"prompt": "hi", "presence_penalty": 3}, ["presence_penalty", "2"], "presence_penalty"),
        ({"prompt": "hi", "logprobs": 50}, ["logprobs", "20"], "logprobs"),
        ({"prompt": "hi", "min_p": 2}, ["min_p", "1"], "min_p"),
        ({"prompt": "hi", "repetition_penalty": 0}, ["repetition_penalty", "0"], "repetition_penalty"),
        ({"prompt": "hi", "max_tokens": 0}, ["max_tokens", "1"], "max_tokens"),
        ({"prompt": "hi", "max_tokens": 4, "min_tokens": 9}, ["min_tokens", "max_tokens"], None),
    ],
)
def test_invalid_fields_name_the_field_and_limit(server, body, needles, param):
    assert_error(post(server, "/v1/completions", body), 400, *needles, param=param)


def test_unknown_model_is_404(server):
    assert_error(post(server, "/v1/completions", {"model": "gpt-17", "prompt": "hi"}), 404, "gpt-17", param="model")


def test_missing_messages(server, model_name):
    assert_error(post(server, "/v1/chat/completions", {"model": model_name}), 400, "messages", param="messages")
    assert_error(post(server, "/v1/chat/completions", {"model": model_name, "messages": []}), 400, "messages")


def test_prompt_longer_than_context(server, model_name):
    long_prompt = "hello " * (MAX_MODEL_LEN + 50)
    r = post(server, "/v1/completions", {"model": model_name, "prompt": long_prompt, "max_tokens": 4})
    assert_error(r, 400, str(MAX_MODEL_LEN), "context length")


def test_max_tokens_that_does_not_fit(server, model_name):
    r = post(server, "/v1/completions", {"model": model_name, "prompt": "hi", "max_tokens": MAX_MODEL_LEN})
    assert_error(r, 400, "max_tokens", str(MAX_MODEL_LEN), param="max_tokens")
    r = post(
        server,
        "/v1/chat/completions",
        {"model": model_name, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 10**6},
    )
    assert_error(r, 400, "max_completion_tokens", str(MAX_MODEL_LEN), param="max_completion_tokens")


def test_oversized_body_is_413(server):
    r = post(server, "/v1/completions", None, raw=b'{"prompt": "' + b"a" * (9 * 1024 * 1024) + b'"}')
    assert_error(r, 413, "limit")


def test_api_key_required_on_v1(server):
    assert_error(post(server, "/v1/models", {}, headers={}), 401)  # wrong method is still auth-checked first
    r = httpx.get(server.v1 + "/models", timeout=10)
    assert_error(r, 401, "API key")
    r = httpx.get(server.v1 + "/models", headers={"Authorization": "Bearer wrong"}, timeout=10)
    assert_error(r, 401, "API key")
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.v1, api_key="nope", max_retries=0).models.list()
    # Health and metrics stay open for probes and scrapers.
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_server_keeps_serving_after_bad_requests(client, model_name, llm):
    out = client.completions.create(model=model_name, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0)
    assert out.choices[0].text == greedy(llm, PROMPTS[0]).text
