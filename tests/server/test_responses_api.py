"""/v1/responses through the official openai client's `client.responses.create` and `.stream` (issue 33):
text, streamed events, function calls, structured output, against the chat route's answer to the same
conversation."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from pydantic import BaseModel

from .conftest import running_server

MODEL = "SmolLM2-135M-Instruct"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def server():
    with running_server("--enable-auto-tool-choice", "--tool-call-parser", "hermes") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.v1, api_key=server.api_key, max_retries=0, timeout=120)


def chat_text(client, messages, **kw) -> str:
    r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)
    return r.choices[0].message.content


def test_text_in_text_out_matches_the_chat_route(client):
    r = client.responses.create(
        model=MODEL, input="Name a colour.", instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    want = chat_text(
        client,
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
        max_tokens=8,
    )
    assert r.object == "response" and r.id.startswith("resp_")
    assert r.output_text == want
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    assert r.usage.output_tokens > 0 and r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    if r.usage.output_tokens == 8:
        assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"


def test_message_list_input_and_stream(client):
    conversation = [
        {"role": "user", "content": "Hi!"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hello."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "Count to three."}]},
    ]
    plain = client.responses.create(model=MODEL, input=conversation, max_output_tokens=12, temperature=0)
    with client.responses.stream(model=MODEL, input=conversation, max_output_tokens=12, temperature=0) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == plain.output_text == final.output_text and len(deltas) > 1
    assert final.usage.output_tokens == plain.usage.output_tokens


def test_raw_event_sequence(client):
    events = list(client.responses.create(model=MODEL, input="Hi", max_output_tokens=4, stream=True))
    types = [e.type for e in events]
    assert types[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert types[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        events[-1].type,
    ] and events[-1].type in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_function_calls_round_trip(client):
    ask = "What is the weather in Paris?"
    r = client.responses.create(
        model=MODEL,
        input=ask,
        tools=[WEATHER],
        tool_choice="required",
        max_output_tokens=60,
    )
    calls = [o for o in r.output if o.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    follow = client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": ask},
            {
                "type": "function_call",
                "call_id": calls[0].call_id,
                "name": "get_weather",
                "arguments": calls[0].arguments,
            },
            {"type": "function_call_output", "call_id": calls[0].call_id, "output": "sunny, 21 C"},
        ],
        tools=[WEATHER],
        tool_choice="none",
        max_output_tokens=10,
    )
    assert follow.output_text
    with client.responses.stream(
        model=MODEL, input="Weather in Rome?", tools=[WEATHER], tool_choice="required", max_output_tokens=60
    ) as stream:
        final = stream.get_final_response()
    assert [o.name for o in final.output if o.type == "function_call"][:1] == ["get_weather"]


class Person(BaseModel):
    name: str
    age: int


def test_structured_output_with_parse(client):
    r = client.responses.parse(model=MODEL, input="Invent a person.", text_format=Person, max_output_tokens=60)
    assert isinstance(r.output_parsed, Person)


def test_previous_response_id_is_refused_with_what_to_do(server):
    body = {"model": MODEL, "input": "Hi", "previous_response_id": "resp_x"}
    r = httpx.post(server.v1 + "/responses", json=body, headers=server.headers())
    assert r.status_code == 400 and "send the whole conversation" in r.json()["error"]["message"]
