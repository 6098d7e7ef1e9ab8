"""No request can stall the server (issue 36): each hostile request of the table is answered with a 400 naming its
field, while a normal request made during it finishes within a few times its idle latency and /health keeps
answering faster than that. Ratios against an idle request measured in the same test only; no absolute times.
Then the whole-request caps, the internals a response must not carry, and the front end's memory after it all."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from .conftest import running_server
from .test_reliability import HealthProbe

PREP_TIMEOUT = 3  # seconds: the nested-range template overruns it
SLOWDOWN = 6  # a normal request during a hostile one may take this many times its idle latency


@pytest.fixture(scope="module")
def server():
    with running_server(
        "--trust-request-chat-template",
        "--request-prep-timeout",
        str(PREP_TIMEOUT),
        "--max-request-tokens",
        "4096",
        "--max-request-sequences",
        "16",
        "--max-request-prompt-tokens",
        "2000",
        "--max-retained-logprobs",
        "10000",
        "--max-num-seqs",
        "4",
        "--max-waiting-requests",
        "8",
        "--tool-call-parser",
        "hermes",
        "--enable-auto-tool-choice",
        "--request-window-sequences",
        "2",
    ) as s:
        yield s


def post(server, path: str, body: dict | None = None, timeout: float = 120, **kw) -> httpx.Response:
    return httpx.post(server.v1 + path, json=body, headers=server.headers(), timeout=timeout, **kw)


def normal(server) -> float:
    """Seconds one small completion takes."""
    t0 = time.monotonic()
    r = post(server, "/completions", {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0})
    assert r.status_code == 200, r.text
    return time.monotonic() - t0


def chat(**kw) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **kw}


def tool(description: str) -> dict:
    return {"type": "function", "function": {"name": "f", "description": description, "parameters": {}}}


NESTED_RANGES = "{% for i in range(100000) %}{% for j in range(100000) %}{{ '' }}{% endfor %}{% endfor %}"

EMPTY_MESSAGES = [{"role": "user", "content": ""}] * 250_000


def big_regex(attempt: int) -> str:
    """61,889 characters, just under --max-grammar-bytes (64 KiB), so it is accepted and compiled (off the step loop);
    a new one on each attempt (a second attempt would otherwise find the first's compile cached)."""
    return "|".join(f"(item{attempt}x{i}-[0-9]+)" for i in range(3150))


HOSTILE = {
    "70k_choices": (
        "/completions",
        {"prompt": "pick", "guided_choice": [f"c{i}" for i in range(70_000)]},
        "guided_choice",
    ),
    "1000_prompts_of_8k_chars": ("/completions", {"prompt": ["x " * 4000] * 1000, "max_tokens": 2}, "prompt"),
    "nested_range_template": ("/chat/completions", chat(chat_template=NESTED_RANGES), "messages"),
    "250k_empty_messages": ("/chat/completions", chat(messages=EMPTY_MESSAGES), "messages"),
    "7mb_template_kwargs": (
        "/chat/completions",
        chat(chat_template_kwargs={"x": "y" * 7_000_000}),
        "chat_template_kwargs",
    ),
    "7mb_tool_description": ("/chat/completions", chat(tools=[tool("d" * 7_000_000)]), "tools"),
    "string_bomb_template": ("/chat/completions", chat(chat_template="{{ 'hello ' * 1500000 }}"), "messages"),
    "62kb_regex": (
        "/completions",
        lambda n: {"prompt": "Pick one:", "max_tokens": 6, "guided_regex": big_regex(n)},
        None,
    ),
    # /v1/responses is the chat route in another shape: its input items are the messages, bounded the same way.
    "250k_empty_response_items": (
        "/responses",
        {"input": [{"role": "user", "content": ""}] * 250_000, "max_output_tokens": 2},
        "input",
    ),
}


@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_request_is_refused_without_stalling_anyone(server, case):
    path, body, param = HOSTILE[case]
    # A second attempt where the first is over a bound: a shared machine's slow spell (one run here: the core's
    # every step 4-20x slower for ~5 s, /health 2.7x) rarely comes twice in a row; a stall this test is for does.
    for attempt in range(2):
        r, during, worst = hostile_run(server, path, body(attempt) if callable(body) else body)
        if param is None:
            assert r.status_code == 200, (case, r.status_code, r.text[:300])
        else:
            assert r.status_code == 400, (case, r.status_code, r.text[:300])
            err = r.json()["error"]
            assert err["param"] == param, err
            assert "Traceback" not in r.text and "backtrace" not in r.text
        print(f"{case}: {r.status_code}; normal request {during:.2f}x idle, worst /health {worst:.2f}x")
        if during <= SLOWDOWN and worst <= SLOWDOWN:
            break
    # The accepted 62 KB regex compiles on the core's grammar thread, not between its steps, and the grammar
    # backend was built before the core said it was ready (a build in the step loop, then the compile: 6.8-8.2x
    # here; off it, 1.4-2.0x).
    assert during <= SLOWDOWN, f"{case}: a normal request took {during:.1f}x its idle time, twice"
    assert worst <= SLOWDOWN, f"{case}: /health took {worst:.1f}x a normal request's idle time, twice"


def hostile_run(server, path: str, body: dict) -> tuple[httpx.Response, float, float]:
    """The hostile request's answer, and how long a normal request made during it and the slowest /health took,
    each in multiples of the normal request's idle time."""
    idle = min(normal(server) for _ in range(3))
    answer: list = []
    hostile = threading.Thread(target=lambda: answer.append(post(server, path, body)), daemon=True)
    with HealthProbe(server) as probe:
        hostile.start()
        time.sleep(0.2)  # under way (uploaded, parsed, being prepared)
        during = normal(server)
        hostile.join(120)
    return answer[0], during / idle, max(probe.latencies) / idle


def test_the_prep_timeout_and_the_trust_flag_are_named(server):
    r = post(server, "/chat/completions", chat(chat_template=NESTED_RANGES))
    assert r.status_code == 400 and "--request-prep-timeout" in r.json()["error"]["message"], r.text
    # The killed worker was replaced: templates render again.
    ok = post(server, "/chat/completions", chat(chat_template="{% for m in messages %}{{ m.content }}{% endfor %}"))
    assert ok.status_code == 200, ok.text


def test_a_small_request_is_not_queued_behind_a_huge_one(server):
    # Three small requests one after another, their median against the idle minimum: one sample alone can meet the
    # step where both running prompts finish and the next two prefill, on a 2-core machine whose engine threads
    # share the cores with the front end (one CI run: 6.4x once, where three runs here read 2.0-2.2x). A small
    # request queued behind the big one would wait in all three. A second attempt where the first is over the
    # bound, as for the hostile requests (one run here met a slow spell: the big request took 183x idle, not
    # ~85x, and the small ones 3.5x, 6.3x, 11.1x).
    for _ in range(2):
        samples, big_time = fairness_run(server)
        ratios = ", ".join(f"{t:.2f}x" for t in samples)
        print(f"fairness: small requests {ratios} idle while a {big_time:.0f}x-idle request ran")
        assert max(samples) < big_time / 2, "a small request waited for most of the big one"
        if sorted(samples)[1] <= SLOWDOWN:
            break
    assert sorted(samples)[1] <= SLOWDOWN, (
        f"small requests took {ratios} their idle time, twice (median over {SLOWDOWN}x)"
    )


def fairness_run(server) -> tuple[list[float], float]:
    """Three small requests made one after another while a big one runs, and the big one, in multiples of a small
    request's idle time."""
    idle = min(normal(server) for _ in range(3))
    # 16 prompts: more sequences than the engine holds at once (4 running + 8 waiting); two run at a time.
    big = {"prompt": [f"{i} " + "word " * 100 for i in range(16)], "max_tokens": 60, "ignore_eos": True}
    answer: list = []
    t0 = time.monotonic()
    thread = threading.Thread(target=lambda: answer.append(post(server, "/completions", big)), daemon=True)
    thread.start()
    time.sleep(1.0)  # its first prompts are running, the others wait in the front end
    samples = [normal(server) for _ in range(3)]
    assert thread.is_alive(), "the big request ended before the small ones did: it no longer measures anything"
    thread.join(300)
    big_time = time.monotonic() - t0
    r = answer[0]
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert sorted(c["index"] for c in choices) == list(range(16))
    assert all(c["finish_reason"] == "length" for c in choices)
    return [t / idle for t in samples], big_time / idle


@pytest.mark.parametrize(
    "body, param, words",
    [
        # 6 prompts x n=2 x 400 tokens: each prompt is under --max-request-tokens, the request is not.
        ({"prompt": ["a b"] * 6, "n": 2, "max_tokens": 400}, "max_tokens", ["4800", "--max-request-tokens"]),
        ({"prompt": ["a b"] * 9, "n": 2, "max_tokens": 2}, "prompt", ["18 sequences", "--max-request-sequences"]),
        ({"prompt": ["word " * 200] * 12, "max_tokens": 2}, "prompt", ["--max-request-prompt-tokens"]),
        ({"prompt": ["a b"] * 8, "max_tokens": 100, "logprobs": 20}, "logprobs", ["--max-retained-logprobs"]),
        # Each prompt's ~100 x 21 prompt logprobs fit, the 9 prompts' do not.
        (
            {"prompt": ["word " * 100] * 9, "max_tokens": 2, "prompt_logprobs": 20},
            "prompt_logprobs",
            ["--max-retained-logprobs"],
        ),
        # More sequences than --max-num-seqs + --max-waiting-requests ever hold: a 400, not a retryable 503.
        ({"prompt": "a b", "n": 13, "max_tokens": 2}, "n", ["--max-waiting-requests"]),
    ],
)
def test_caps_hold_for_the_whole_request(server, body, param, words):
    r = post(server, "/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    for w in words:
        assert w in err["message"], err


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "hi \ud800 there", "max_tokens": 2}, "prompt"),
        ({"prompt": "hi", "n": True}, "n"),
        ({"prompt": "hi", "max_tokens": "4"}, "max_tokens"),
    ],
)
def test_bad_values_get_our_own_words(server, body, param):
    # As a client that escapes a lone surrogate (json.dumps does; httpx's encoder refuses it).
    headers = {**server.headers(), "Content-Type": "application/json"}
    r = httpx.post(server.v1 + "/completions", content=json.dumps(body), headers=headers, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert "TextEncodeInput" not in err["message"]


@pytest.mark.parametrize(
    "path, body, param",
    [
        ("/completions", {"prompt": "hi", "prompt_logprobs": True}, "prompt_logprobs"),
        ("/chat/completions", chat(prompt_logprobs="1"), "prompt_logprobs"),
        ("/responses", {"input": "hi", "max_output_tokens": True}, "max_output_tokens"),
    ],
)
def test_integer_fields_of_every_route_refuse_booleans_and_strings(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


SCHEMA_70KB = {"enum": ["x" * 100] * 700}


@pytest.mark.parametrize(
    "path, body, param, flag",
    [
        ("/responses", {"input": [{"role": "user", "content": "hi"}] * 2049}, "input", "--max-chat-messages"),
        (
            "/responses",
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": SCHEMA_70KB}}},
            "text.format.schema",
            "--max-grammar-bytes",
        ),
        ("/responses", {"input": "hi", "tools": [{"type": "function", "name": "f"}] * 129}, "tools", "--max-tools"),
        (
            "/chat/completions",
            chat(response_format={"type": "json_schema", "schema": SCHEMA_70KB}),
            "response_format.schema",
            "--max-grammar-bytes",
        ),
        ("/completions", {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "1024"),
    ],
)
def test_the_newer_request_shapes_are_bounded_before_any_work(server, path, body, param, flag):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and flag in err["message"], err


def test_a_chunked_body_over_the_limit_gets_413_like_a_sized_one(server):
    blob = b"x" * (9 * 1024 * 1024)
    chunks = (blob[i : i + 65536] for i in range(0, len(blob), 65536))
    r = httpx.post(server.v1 + "/completions", content=chunks, headers=server.headers(), timeout=60)
    assert r.status_code == 413 and "--max-request-body-bytes" in r.json()["error"]["message"], r.text


def test_deep_json_in_a_request_is_not_a_500(server):
    deep = "[" * 1200 + "]" * 1200
    msgs = [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    r = post(server, "/chat/completions", {"messages": msgs, "max_tokens": 2})
    assert r.status_code in (200, 400), r.text
    body = '{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}"
    r = httpx.post(server.url + "/detokenize", content=body, headers=server.headers(), timeout=30)
    assert r.status_code == 400, r.text


def _rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_large_requests_leave_the_front_end_memory_where_it_was(server):
    # The growth came from a 7 MB /tokenize, a template string bomb and template lists kept by a cache.
    normal(server)
    before = _rss(server.proc.pid)
    for _ in range(3):
        post(server, "/tokenize", {"prompt": "word " * 1_400_000})
        post(server, "/chat/completions", chat(chat_template="{{ 'hello ' * 1500000 }}"))
        post(server, "/chat/completions", chat(chat_template="{{ range(90000) | list | join(',') }}"))
        post(server, "/chat/completions", chat(messages=[{"role": "user", "content": "z " * 20_000}]))
    after = _rss(server.proc.pid)
    assert after <= 1.25 * before, f"front end RSS {before} -> {after} kB"
    assert json.loads(httpx.get(server.url + "/health", timeout=10).text) == {"status": "healthy"}
