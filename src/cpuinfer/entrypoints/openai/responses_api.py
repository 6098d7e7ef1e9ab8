"""POST /v1/responses: OpenAI's Responses API for text in and out, function calls and structured output,
streamed or not, served by the chat route's machinery.

A Responses request is translated into the chat request it means (input items -> messages, instructions ->
a system message, text.format -> response_format, function tools -> tools), started like a chat, and
answered in the Responses shape by ResponsesFormat: one `response` object, or its stream of typed events
(response.created ... response.output_text.delta ... response.completed). Nothing is stored: a request naming
previous_response_id is refused, since there is no earlier response to continue from.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from cpuinfer.entrypoints.openai.engine_adapter import ChoiceDelta
from cpuinfer.entrypoints.openai.formats import ResponseFormat
from cpuinfer.entrypoints.openai.job import Job
from cpuinfer.entrypoints.openai.protocol import UsageInfo
from cpuinfer.entrypoints.openai.responses_protocol import ResponsesRequest
from cpuinfer.entrypoints.openai.tokenization import Tokenization
from cpuinfer.entrypoints.openai.tool_calls import ToolCallStream
from cpuinfer.entrypoints.openai.tool_parsers import ToolParser


def response_id() -> str:
    """An id in OpenAI's spelling, resp_<hex>."""
    return f"resp_{uuid.uuid4().hex}"


class ResponsesFormat(ResponseFormat):
    """A job's output as a Responses API `response` object, or as its stream of events.

    Text streams as output_text deltas; with a tool parser the reply is held back and its text and function
    calls are sent as whole items at the end (a call's arguments are only known once it is complete)."""

    def __init__(
        self, job: Job, model_name: str, tokenization: Tokenization, req: ResponsesRequest, parser: ToolParser | None
    ):
        super().__init__(job, model_name, tokenization)
        self.req = req
        self.parser = parser
        self.created = time.time()
        self.sequence = 0
        self.text = ""
        self.tokens = 0
        self.message_id = f"msg_{uuid.uuid4().hex}"

    # ---- the response object ----------------------------------------------------------------------

    def _object(self, status: str, output: list[dict], usage: UsageInfo | None, finish: str | None = None) -> dict:
        req = self.req
        return {
            "id": self.job.request_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model_name,
            "output": output,
            "usage": _usage(usage) if usage is not None else None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "error": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "parallel_tool_calls": req.parallel_tool_calls if req.parallel_tool_calls is not None else True,
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "text": {
                "format": (
                    req.text.format.model_dump(by_alias=True, exclude_none=True)
                    if req.text and req.text.format
                    else {"type": "text"}
                )
            },
            "tool_choice": _tool_choice(req.tool_choice),
            "tools": [t.model_dump(exclude_none=True) for t in req.tools or []],
            "truncation": "disabled",
            "metadata": req.metadata or {},
            "user": req.user,
        }

    def _items(self, text: str, done: bool) -> list[dict]:
        """The output items of a finished reply: the message (if it has text) and each function call."""
        calls = []
        if self.parser is not None:
            text, calls = ToolCallStream(self.parser, text).final_calls()
        status = "completed" if done else "in_progress"
        items = []
        if text or not calls:
            items.append(self._message(text, status))
        for c in calls:
            items.append(
                {
                    "type": "function_call",
                    "id": f"fc_{uuid.uuid4().hex}",
                    "call_id": c.id,
                    "name": c.function.name,
                    "arguments": c.function.arguments,
                    "status": "completed",
                }
            )
        return items

    def _message(self, text: str, status: str) -> dict:
        return {
            "type": "message",
            "id": self.message_id,
            "status": status,
            "role": "assistant",
            "content": [_part(text)] if status == "completed" or text else [],
        }

    def response(self) -> dict:
        """The whole response (non-streaming)."""
        s = self.job.states[0]
        status = "incomplete" if s.finish_reason == "length" else "completed"
        return self._object(status, self._items(s.text, True), self.job.usage(), s.finish_reason)

    # ---- the stream of events ---------------------------------------------------------------------

    def _event(self, type_: str, **fields) -> dict:
        self.sequence += 1
        return {"type": type_, "sequence_number": self.sequence - 1, **fields}

    def opening(self) -> list[dict]:
        """response.created and .in_progress; for plain text also the message item and its text part."""
        events = [
            self._event("response.created", response=self._object("in_progress", [], None)),
            self._event("response.in_progress", response=self._object("in_progress", [], None)),
        ]
        if self.parser is None:
            events += [
                self._event("response.output_item.added", output_index=0, item=self._message("", "in_progress")),
                self._event(
                    "response.content_part.added",
                    item_id=self.message_id,
                    output_index=0,
                    content_index=0,
                    part=_part(""),
                ),
            ]
        return events

    def chunk(self, d: ChoiceDelta) -> list[dict] | None:
        """The events of one delta: a text delta, and at the end the closing events and response.completed."""
        self.text += d.text
        self.tokens += len(d.token_ids)
        events = []
        if self.parser is None and d.text:
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self.message_id,
                    output_index=0,
                    content_index=0,
                    delta=d.text,
                    logprobs=[],
                )
            )
        if d.finish_reason is not None:
            events += self._closing(d.finish_reason)
        return events or None

    def _closing(self, finish: str) -> list[dict]:
        items = self._items(self.text, True)
        events = []
        if self.parser is None:
            ref = {"item_id": self.message_id, "output_index": 0, "content_index": 0}
            events += [
                self._event("response.output_text.done", **ref, text=self.text, logprobs=[]),
                self._event("response.content_part.done", **ref, part=_part(self.text)),
                self._event("response.output_item.done", output_index=0, item=items[0]),
            ]
        else:
            for i, item in enumerate(items):
                events.append(self._event("response.output_item.added", output_index=i, item=item))
                if item["type"] == "function_call":
                    events.append(
                        self._event(
                            "response.function_call_arguments.done",
                            item_id=item["id"],
                            output_index=i,
                            arguments=item["arguments"],
                        )
                    )
                events.append(self._event("response.output_item.done", output_index=i, item=item))
        prompt = self.job.prompt_tokens
        usage = UsageInfo(prompt_tokens=prompt, completion_tokens=self.tokens, total_tokens=prompt + self.tokens)
        status, kind = (
            ("incomplete", "response.incomplete") if finish == "length" else ("completed", "response.completed")
        )
        events.append(self._event(kind, response=self._object(status, items, usage, finish)))
        return events

    def usage_chunk(self, usage: UsageInfo) -> dict:  # noqa: ARG002 - the final event carries the usage
        """Not used: response.completed carries the usage."""
        raise AssertionError("the Responses stream has no usage chunk")


def _part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(u: UsageInfo) -> dict:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.total_tokens,
    }


def _tool_choice(choice) -> Any:
    if choice is None:
        return "auto"
    return choice if isinstance(choice, str) else choice.model_dump()
