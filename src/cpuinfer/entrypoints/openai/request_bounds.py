"""Cheap bounds on a request body, checked on the parsed JSON before any heavy work (pydantic models of thousands of
messages, template rendering, tokenization, grammar compilation): each is a `serve` flag, and a request over one
gets a 400 naming the field, the limit and the flag.

The bound on prompt text is not a flag of its own: a text longer than the context length times the longest token's
text can never fit the context, so it is refused without being tokenized (per prompt, and for the whole request
against --max-request-prompt-tokens).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cpuinfer.entrypoints.openai.errors import APIError
from cpuinfer.sampling_params import MAX_LOGIT_BIAS

# vLLM's scoring routes (openai/scoring.py): their texts are bounded as a completion's prompts are.
SCORING_ROUTES = ("/score", "/v1/score", "/rerank", "/v1/rerank", "/v2/rerank", "/classify", "/v1/classify")


@dataclass(frozen=True)
class RequestBounds:
    """What one request body may hold (the defaults are the CLI's)."""

    max_messages: int = 2048
    max_choices: int = 1024  # entries of guided_choice / structured_outputs.choice
    # OpenAI caps a schema near 15k characters of names and enums; each new grammar is also compiled by the engine
    # core between steps (~0.1 s at 64 KiB, 0.3-0.6 s for a 126 KB schema), delaying every running request.
    max_grammar_bytes: int = 64 * 1024  # a JSON schema, regex, grammar or choice list, as JSON text
    max_tools: int = 128  # OpenAI's own limit
    max_tools_bytes: int = 256 * 1024  # all tool definitions, as JSON text
    max_chat_template_kwargs_bytes: int = 64 * 1024
    trust_request_chat_template: bool = False
    prep_workers: int = 2
    prep_timeout: float = 10.0  # seconds
    window_sequences: int = 16  # sequences of one request in the engine at once

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RequestBounds:
        """The bounds the `serve` flags set."""
        return cls(
            max_messages=args.max_chat_messages,
            max_choices=args.max_structured_choices,
            max_grammar_bytes=args.max_grammar_bytes,
            max_tools=args.max_tools,
            max_tools_bytes=args.max_tools_bytes,
            max_chat_template_kwargs_bytes=args.max_chat_template_kwargs_bytes,
            trust_request_chat_template=args.trust_request_chat_template,
            prep_workers=args.request_prep_workers,
            prep_timeout=args.request_prep_timeout,
            window_sequences=args.request_window_sequences,
        )


def add_bounds_arguments(parser: argparse.ArgumentParser, positive_int) -> None:
    """The `serve` flags of RequestBounds."""
    d = RequestBounds()
    g = parser.add_argument_group("request body bounds (checked before any work; a request over one gets a 400)")
    g.add_argument("--max-chat-messages", type=positive_int, default=d.max_messages, help="Most messages per chat.")
    g.add_argument(
        "--max-structured-choices",
        type=positive_int,
        default=d.max_choices,
        help="Most entries of guided_choice / structured_outputs.choice.",
    )
    g.add_argument(
        "--max-grammar-bytes",
        type=positive_int,
        default=d.max_grammar_bytes,
        help="Largest output constraint (JSON schema, regex, grammar, choice list) as JSON text.",
    )
    g.add_argument("--max-tools", type=positive_int, default=d.max_tools, help="Most tools per chat request.")
    g.add_argument(
        "--max-tools-bytes", type=positive_int, default=d.max_tools_bytes, help="Largest tools list as JSON text."
    )
    g.add_argument(
        "--max-chat-template-kwargs-bytes",
        type=positive_int,
        default=d.max_chat_template_kwargs_bytes,
        help="Largest chat_template_kwargs as JSON text.",
    )
    g.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a chat_template in requests (vLLM's flag; refused by default). It still renders in a "
        "sandbox, within --request-prep-timeout and an output-size limit",
    )
    g.add_argument(
        "--request-window-sequences",
        type=positive_int,
        default=d.window_sequences,
        help="sequences of one request in the engine at once: a request of many prompts starts the rest as "
        "earlier ones finish, so other clients' requests are not queued behind it",
    )
    g.add_argument(
        "--request-prep-workers",
        type=positive_int,
        default=d.prep_workers,
        help="worker processes that render chat templates and tokenize large prompts, off the HTTP loop",
    )
    g.add_argument(
        "--request-prep-timeout",
        type=float,
        default=d.prep_timeout,
        help="seconds a request's template rendering and tokenization may take (then a 400; 503 if every "
        "worker stays busy that long)",
    )


def json_size(value: Any) -> int:
    """Length of `value` as compact JSON text."""
    if isinstance(value, str):
        return len(value)
    return len(json.dumps(value, separators=(",", ":"), ensure_ascii=False, default=str))


def _too_big(field: str, what: str, got: int, limit: int, flag: str, unit: str = "") -> APIError:
    return APIError(
        f"{field} {what} {got}{unit}; at most {limit}{unit} are allowed ({flag}): send less", 400, field.split(" ")[0]
    )


def text_chars(value: Any) -> int:
    """Characters of prompt text in a `prompt` or a message `content` (strings, lists of them, text parts)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, list):
        total = 0
        for x in value:
            if isinstance(x, str):
                total += len(x)
            elif isinstance(x, dict) and isinstance(x.get("text"), str):
                total += len(x["text"])
        return total
    return 0


def check_body(
    route: str, body: Any, bounds: RequestBounds, chars_per_prompt: int | None, chars_per_request: int | None
) -> None:
    """Refuse a body over a bound (APIError 400 naming the field); anything else is pydantic's to judge.

    chars_per_prompt / chars_per_request: the most characters of prompt text that could ever fit the context / the
    request's prompt-token budget (None while the model is loading)."""
    if not isinstance(body, dict):
        return
    messages = body.get("messages")
    if isinstance(messages, list):
        _check_conversation(
            "messages",
            len(messages),
            lambda: sum(text_chars(m.get("content")) for m in messages if isinstance(m, dict)),
            bounds,
            chars_per_prompt,
        )
    if route == "/v1/responses":
        _check_responses_input(body, bounds, chars_per_prompt)
    if route.endswith("/completions") or route == "/tokenize":
        _check_prompt_texts("prompt", body.get("prompt"), chars_per_prompt, chars_per_request)
    if route == "/v1/embeddings" and body.get("truncate_prompt_tokens") is None:  # else only the last tokens count
        _check_prompt_texts("input", body.get("input"), chars_per_prompt, chars_per_request)
    if route in SCORING_ROUTES and body.get("truncate_prompt_tokens") is None:
        for field in ("text_1", "text_2", "query", "documents", "input"):
            if field in body:
                _check_prompt_texts(field, body[field], chars_per_prompt, chars_per_request)
    _check_constraints(body, bounds)
    bias = body.get("logit_bias")
    if isinstance(bias, dict) and len(bias) > MAX_LOGIT_BIAS:
        raise APIError(f"logit_bias has {len(bias)} entries; at most {MAX_LOGIT_BIAS} are allowed", 400, "logit_bias")
    tools = body.get("tools")
    if isinstance(tools, list):
        if len(tools) > bounds.max_tools:
            raise _too_big("tools", "has", len(tools), bounds.max_tools, "--max-tools", " tools")
        size = json_size(tools)
        if size > bounds.max_tools_bytes:
            raise _too_big("tools", "take", size, bounds.max_tools_bytes, "--max-tools-bytes", " bytes of JSON")
    kwargs = body.get("chat_template_kwargs")
    if kwargs is not None:
        size = json_size(kwargs)
        if size > bounds.max_chat_template_kwargs_bytes:
            raise _too_big(
                "chat_template_kwargs",
                "take",
                size,
                bounds.max_chat_template_kwargs_bytes,
                "--max-chat-template-kwargs-bytes",
                " bytes of JSON",
            )
    if body.get("chat_template") is not None and not bounds.trust_request_chat_template:
        raise APIError(
            "chat_template in a request is refused: this server renders only its own chat template. Start it "
            "with --trust-request-chat-template to accept request templates, or remove chat_template.",
            400,
            "chat_template",
        )


def _check_prompt_texts(field: str, prompt: Any, chars_per_prompt: int | None, chars_per_request: int | None) -> None:
    """A `prompt` (or /v1/embeddings' `input`): a text, or a list of texts, each within what the context could hold,
    all within what the request's prompt-token cap could."""
    texts = prompt if isinstance(prompt, list) and all(isinstance(p, str) for p in prompt) else [prompt]
    for text in texts:
        if chars_per_prompt is not None and isinstance(text, str) and len(text) > chars_per_prompt:
            raise APIError(
                f"{field} has {len(text)} characters, more than this model's maximum context length could ever hold "
                f"({chars_per_prompt} characters: the context length times the longest token's text); shorten it",
                400,
                field,
            )
    total = text_chars(prompt)
    if chars_per_request is not None and total > chars_per_request:
        raise APIError(
            f"the {field}s hold {total} characters in all, more than --max-request-prompt-tokens could ever "
            f"allow ({chars_per_request} characters); send fewer or shorter {field}s",
            400,
            field,
        )


def _check_conversation(
    field: str, messages: int, chars_of: Callable[[], int], bounds: RequestBounds, chars_per_prompt: int | None
) -> None:
    """A conversation's message count, then its characters of text (`chars_of()`, counted only once the count is
    within its bound: a list of 250k items is refused at len(), not after a pass over every item)."""
    if messages > bounds.max_messages:
        raise _too_big(field, "has", messages, bounds.max_messages, "--max-chat-messages", " messages")
    if chars_per_prompt is None:
        return
    chars = chars_of()
    if chars > chars_per_prompt:
        raise APIError(
            f"{field} hold{'' if field == 'messages' else 's'} {chars} characters of text, more than this model's "
            f"maximum context length could ever hold ({chars_per_prompt} characters: the context length times the "
            "longest token's text); shorten them",
            400,
            field,
        )


def _check_responses_input(body: dict, bounds: RequestBounds, chars_per_prompt: int | None) -> None:
    """/v1/responses: `input` (a text or a list of items, each a message of the chat it means) and `instructions`
    (one more message) as the conversation; `text.format.schema` as an output constraint."""
    items = body.get("input")
    instructions = body.get("instructions")
    listed = items if isinstance(items, list) else [items] if isinstance(items, str) else []
    count = len(listed) + (1 if instructions else 0)

    def chars() -> int:
        total = len(instructions) if isinstance(instructions, str) else 0
        for item in listed:
            if isinstance(item, str):
                total += len(item)
            elif isinstance(item, dict):
                total += sum(text_chars(item.get(k)) for k in ("content", "arguments", "output"))
        return total

    _check_conversation("input", count, chars, bounds, chars_per_prompt)
    text = body.get("text")
    fmt = text.get("format") if isinstance(text, dict) else None
    if isinstance(fmt, dict) and fmt.get("schema") is not None:
        size = json_size(fmt["schema"])
        if size > bounds.max_grammar_bytes:
            raise _too_big(
                "text.format.schema", "takes", size, bounds.max_grammar_bytes, "--max-grammar-bytes", " bytes"
            )


def _check_constraints(body: dict, bounds: RequestBounds) -> None:
    """Choice count and grammar size of every field that can carry an output constraint."""
    so = body.get("structured_outputs")
    fields: list[tuple[str, Any]] = [(f"guided_{k}", body.get(f"guided_{k}")) for k in ("json", "regex", "grammar")]
    choices: list[tuple[str, Any]] = [("guided_choice", body.get("guided_choice"))]
    if isinstance(so, dict):
        fields += [(f"structured_outputs.{k}", so.get(k)) for k in ("json", "regex", "grammar")]
        choices.append(("structured_outputs.choice", so.get("choice")))
    rf = body.get("response_format")
    if isinstance(rf, dict):
        if isinstance(rf.get("json_schema"), dict):
            fields.append(("response_format.json_schema.schema", rf["json_schema"].get("schema")))
        fields.append(("response_format.schema", rf.get("schema")))  # instructor's spelling
    for name, value in choices:
        if isinstance(value, list) and len(value) > bounds.max_choices:
            raise _too_big(name, "has", len(value), bounds.max_choices, "--max-structured-choices", " entries")
        fields.append((name, value))
    for name, value in fields:
        if value is None:
            continue
        size = json_size(value)
        if size > bounds.max_grammar_bytes:
            raise _too_big(name, "takes", size, bounds.max_grammar_bytes, "--max-grammar-bytes", " bytes")
