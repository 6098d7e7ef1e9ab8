"""Tool-call parsers on recorded model outputs (well-formed, malformed, partial, several calls), and the stream of
delta.tool_calls pieces: fed token by token, the pieces add up to what the whole text parses to."""

from __future__ import annotations

import json

import pytest

from cpuinfer.entrypoints.openai.tool_calls import NamedCallParser, RequiredCallsParser, ToolCallStream
from cpuinfer.entrypoints.openai.tool_parsers import TOOL_PARSERS

HERMES = TOOL_PARSERS["hermes"]()
LLAMA = TOOL_PARSERS["llama3_json"]()

# Recorded from Qwen2.5-style models (the hermes format) and Llama 3.x.
QWEN_ONE = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
QWEN_TWO = (
    'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
)
LLAMA_TWO = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "get_time", "parameters": {}}'
)


def calls(parsed):
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls if c.complete]


def test_hermes_one_call():
    out = HERMES.parse(QWEN_ONE, final=True)
    assert out.content == ""
    assert calls(out) == [("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_hermes_several_calls_with_text_around():
    out = HERMES.parse(QWEN_TWO, final=True)
    assert out.content.strip() == "Let me check both."
    assert calls(out) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "Europe/Paris"})]


@pytest.mark.parametrize(
    "text",
    [
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Par</tool_call>',  # truncated JSON, closed tag
        "<tool_call>not json at all</tool_call>",
        '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',  # no name
    ],
)
def test_hermes_malformed_call_stays_content(text):
    out = HERMES.parse("Hi " + text, final=True)
    assert out.calls == [] and out.content == "Hi " + text


def test_hermes_unclosed_call_at_the_end_is_content_when_final_and_partial_while_streaming():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
    assert HERMES.parse(text, final=True).content == text
    partial = HERMES.parse(text, final=False)
    assert partial.content == "" and partial.calls[0].name == "get_weather"
    assert partial.calls[0].arguments == '{"city": "Pa' and not partial.calls[0].complete


def test_hermes_plain_text_has_no_calls_and_holds_back_a_partial_tag():
    assert HERMES.parse("The weather is nice.", final=True).content == "The weather is nice."
    assert HERMES.parse("Sure <tool_", final=False).content == "Sure "


def test_llama3_json_calls_and_plain_replies():
    assert calls(LLAMA.parse(LLAMA_TWO, final=True)) == [("get_weather", {"city": "Oslo"}), ("get_time", {})]
    assert calls(LLAMA.parse('{"name": "f", "parameters": {"x": 1}}', final=True)) == [("f", {"x": 1})]
    assert LLAMA.parse("It is sunny in Oslo.", final=True).content == "It is sunny in Oslo."
    bad = '{"name": "f", "parameters": {"x": }'
    assert LLAMA.parse(bad, final=True).content == bad
    trailing = '{"name": "f", "parameters": {}} and some prose'
    assert LLAMA.parse(trailing, final=True).content == trailing


def test_required_and_named_replies():
    text = '[{"name": "get_weather", "parameters": {"city": "Rome"}}, {"name": "get_time", "parameters": {}}]'
    assert calls(RequiredCallsParser().parse(text, final=True)) == [("get_weather", {"city": "Rome"}), ("get_time", {})]
    assert calls(NamedCallParser("f").parse(' {"a": 1}', final=True)) == [("f", {"a": 1})]


@pytest.mark.parametrize(
    ("parser", "text"),
    [
        (HERMES, QWEN_ONE),
        (HERMES, QWEN_TWO),
        (LLAMA, LLAMA_TWO),
        (
            RequiredCallsParser(),
            '[{"name": "a", "parameters": {"s": "x\\"y"}}, {"name": "b", "parameters": {"n": 1.5}}]',
        ),
        (NamedCallParser("f"), '{"q": "a long \\u00e9 string", "n": [1, 2, {"k": null}]}'),
    ],
)
def test_streamed_pieces_add_up_to_the_final_calls(parser, text):
    stream = ToolCallStream(parser)
    content, names, args = "", {}, {}
    for i in range(0, len(text), 3):  # 3-character "tokens"
        piece = text[i : i + 3]
        c, deltas = stream.feed(piece, final=i + 3 >= len(text))
        content += c
        for d in deltas:
            if d.function.name is not None:
                assert d.index not in names, "a call's name is sent once"
                names[d.index] = d.function.name
            args[d.index] = args.get(d.index, "") + (d.function.arguments or "")
    final_content, final_calls = stream.final_calls()
    assert content == final_content
    assert [(c.function.name, c.function.arguments) for c in final_calls] == [
        (names[i], args[i]) for i in sorted(names)
    ]
    for c in final_calls:
        json.loads(c.function.arguments)


@pytest.mark.parametrize("parser", [HERMES, LLAMA], ids=["hermes", "llama3_json"])
@pytest.mark.parametrize("where", ["name", "arguments"])
def test_a_call_nested_past_the_depth_bound_is_content_not_an_error(parser, where):
    deep = "[" * 1200 + "]" * 1200  # json.loads would raise RecursionError on it
    call = {"name": deep, "arguments": {}} if where == "name" else {"name": "f", "arguments": {"x": 1}}
    text = json.dumps(call).replace('"' + deep + '"', deep) if where == "name" else json.dumps(call)
    if where == "arguments":
        text = text.replace('{"x": 1}', '{"x": ' + deep + "}")
    if parser is HERMES:
        text = f"<tool_call>{text}</tool_call>"
    out = parser.parse(text, final=True)
    assert out.calls == [] and out.content == text  # returned as text, as vLLM does
    stream = ToolCallStream(parser)  # streamed piece by piece it never raises either
    for i in range(0, len(text), 50):
        stream.feed(text[i : i + 50], final=i + 50 >= len(text))
    assert stream.final_calls() == (text, [])


def test_a_compiler_panic_is_one_sentence_without_its_backtrace():
    from cpuinfer.structured.backend import invalid

    panic = (
        "panic: assertion failed: grammar.symbols.len() < u16::MAX\n<backtrace>\n  0: <unknown>\n"
        "  1: /home/runner/.cargo/registry/src/index.crates.io/llguidance-1.0/src/grammar.rs:120"
    )
    err = invalid("choice", panic)
    assert "backtrace" not in err.message and "u16::MAX" not in err.message and ".rs" not in err.message
    assert err.param == "structured_outputs.choice" and "too large" in err.message
    assert invalid("regex", "unclosed group at 3").message.endswith("unclosed group at 3")
