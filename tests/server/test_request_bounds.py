"""The conversation bounds of the server's guard (request_bounds.check_body), called directly: a list over
--max-chat-messages is refused by its length, before any item is read (a 250k-item body had spent 0.92 s on the
event loop summing text first); within it, the characters of every text the conversation holds are counted."""

from __future__ import annotations

import pytest

from cpuinfer.entrypoints.openai.errors import APIError
from cpuinfer.entrypoints.openai.request_bounds import RequestBounds, check_body


class Untouchable(dict):
    """A message the check must not read."""

    def get(self, *_):
        raise AssertionError("an item of an over-long conversation was read")


BOUNDS = RequestBounds(max_messages=4)


@pytest.mark.parametrize(
    ("route", "field"), [("/v1/chat/completions", "messages"), ("/v1/responses", "input")], ids=["chat", "responses"]
)
def test_too_many_items_are_refused_without_reading_one(route, field):
    body = {field: [Untouchable(role="user", content="hi")] * 250_000}
    with pytest.raises(APIError, match=f"{field} has 250000 messages; at most 4") as e:
        check_body(route, body, BOUNDS, 1000, None)
    assert e.value.param == field and "--max-chat-messages" in str(e.value)


def test_responses_characters_count_every_text_it_holds():
    # instructions 5 + content 7 + arguments 2 + output 6 = 20 characters, in 4 messages (instructions are one)
    body = {
        "instructions": "12345",
        "input": [
            {"role": "user", "content": "abcdefg"},
            {"type": "function_call", "arguments": "{}"},
            {"type": "function_call_output", "output": "result"},
        ],
    }
    check_body("/v1/responses", body, BOUNDS, 20, None)
    with pytest.raises(APIError, match="input holds 20 characters") as e:
        check_body("/v1/responses", body, BOUNDS, 19, None)
    assert e.value.param == "input"
    check_body("/v1/responses", {"input": "x" * 19}, BOUNDS, 19, None)
    with pytest.raises(APIError, match="input holds 20 characters"):
        check_body("/v1/responses", {"input": "x" * 20}, BOUNDS, 19, None)


def test_chat_characters_count_every_message():
    body = {"messages": [{"role": "user", "content": "x" * 10}, {"role": "assistant", "content": "y" * 10}]}
    check_body("/v1/chat/completions", body, BOUNDS, 20, None)
    with pytest.raises(APIError, match="messages hold 20 characters"):
        check_body("/v1/chat/completions", body, BOUNDS, 19, None)
    check_body("/v1/chat/completions", body, BOUNDS, None, None)  # the model is loading: no character bound
