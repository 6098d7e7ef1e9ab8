"""How a route shapes what its job produced: completions and chat each have a ResponseFormat, which makes
the stream's chunks and the whole non-streaming response. Everything else about responding (the event
stream, usage, the error event, the request log, [DONE]) is the responder's, shared by both routes."""

from __future__ import annotations

import math
import time

from pydantic import BaseModel

from cpuinfer.entrypoints.openai.engine_adapter import ChoiceDelta, TokenLogprob
from cpuinfer.entrypoints.openai.job import ChoiceState, Job
from cpuinfer.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogProbs,
    ChatResponseMessage,
    ChatStreamChoice,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    PromptLogprob,
    SamplingFields,
    TopLogprob,
    UsageInfo,
    dump,
)
from cpuinfer.entrypoints.openai.tokenization import Tokenization
from cpuinfer.entrypoints.openai.tool_calls import ToolCallStream
from cpuinfer.entrypoints.openai.tool_parsers import ToolParser

MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to this too


def _lp(x: float) -> float:
    return MIN_LOGPROB if (math.isnan(x) or x < MIN_LOGPROB) else float(x)


def continuous_usage(req: SamplingFields) -> bool:
    """Whether every chunk of the stream carries the usage so far."""
    return bool(req.stream_options and req.stream_options.continuous_usage_stats)


class ResponseFormat:
    """How one route shapes its chunks and its response."""

    def __init__(self, job: Job, model_name: str, tokenization: Tokenization):
        self.job = job
        self.model_name = model_name
        self.tokenization = tokenization
        self.created = int(time.time())

    def opening(self) -> list[dict]:
        """Chunks sent before the first delta."""
        return []

    def chunk(self, d: ChoiceDelta) -> dict | list[dict] | None:
        """The chunk for one delta (called before the delta is absorbed), a list of events where one delta is
        several, or None when it carries nothing."""
        raise NotImplementedError

    def usage_chunk(self, usage: UsageInfo) -> dict:
        """The final usage-only chunk."""
        raise NotImplementedError

    def response(self) -> BaseModel | dict:
        """The whole non-streaming response."""
        raise NotImplementedError


class CompletionFormat(ResponseFormat):
    """/v1/completions: text choices, legacy logprobs, optional echo of the prompt."""

    def __init__(self, job: Job, model_name: str, tokenization: Tokenization, req: CompletionRequest):
        super().__init__(job, model_name, tokenization)
        self.req = req
        # echo with logprobs: the echo waits for the prompt's logprobs, which come with the first delta.
        self.echo_with_logprobs = req.echo and req.logprobs is not None
        self.echoed: set[int] = set()

    def _body(self, choices: list[CompletionChoice], usage: UsageInfo | None) -> dict:
        return dump(
            CompletionResponse(
                id=self.job.request_id, created=self.created, model=self.model_name, choices=choices, usage=usage
            )
        )

    def _echo(self, i: int) -> str:
        return (self.job.prompts[i // self.job.n].text or "") if self.req.echo else ""

    def _logprobs(
        self, entries: list[TokenLogprob], offset: int, prompt: tuple[list[int], list] | None = None
    ) -> CompletionLogProbs | None:
        """Legacy completions logprobs of generated tokens, text offsets from `offset`; with `prompt` (its token
        ids and prompt logprobs: echo), the prompt's tokens first, from offset 0 (the first has no logprob)."""
        k = self.req.logprobs
        if k is None:
            return None
        token_text = self.tokenization.token_text
        out = CompletionLogProbs()
        if prompt is not None:
            at = 0
            for tok, e in zip(*prompt, strict=True):
                text = token_text(tok)
                out.tokens.append(text)
                out.token_logprobs.append(None if e is None else _lp(e.logprob))
                out.top_logprobs.append(None if e is None else self._top(e, text, k))
                out.text_offset.append(at)
                at += len(text)
        for e in entries:
            text = token_text(e.token_id)
            out.tokens.append(text)
            out.token_logprobs.append(_lp(e.logprob))
            out.top_logprobs.append(self._top(e, text, k))
            out.text_offset.append(offset)
            offset += len(text)
        return out

    def _top(self, e: TokenLogprob, text: str, k: int) -> dict[str, float]:
        token_text = self.tokenization.token_text
        top = {token_text(t): _lp(lp) for t, lp in e.top[:k]}
        top.setdefault(text, _lp(e.logprob))
        return top

    def _prompt_part(self, i: int, prompt_lps: list | None) -> tuple[list[int], list] | None:
        """(prompt token ids, their logprobs) of choice i, for echo with logprobs."""
        if not self.echo_with_logprobs or prompt_lps is None:
            return None
        return self.job.prompts[i // self.job.n].token_ids, prompt_lps

    def opening(self) -> list[dict]:
        if not self.req.echo or self.echo_with_logprobs:
            return []
        return [self._body([CompletionChoice(index=i, text=self._echo(i))], None) for i in range(len(self.job.states))]

    def chunk(self, d: ChoiceDelta) -> dict | None:
        prefix, prompt = "", None
        if self.echo_with_logprobs and d.index not in self.echoed:
            self.echoed.add(d.index)
            prefix, prompt = self._echo(d.index), self._prompt_part(d.index, d.prompt_logprobs)
        offset = len(self._echo(d.index)) + len(self.job.states[d.index].text)
        lp = self._logprobs(d.logprobs or [], offset, prompt)
        plp = vllm_prompt_logprobs(d.prompt_logprobs, self.req.prompt_logprobs, self.tokenization)
        if not (prefix or d.text or d.finish_reason is not None or (lp and lp.tokens) or plp):
            return None
        choice = CompletionChoice(
            index=d.index,
            text=prefix + d.text,
            logprobs=lp,
            finish_reason=d.finish_reason,
            stop_reason=d.stop_reason,
            prompt_logprobs=plp,
        )
        return self._body([choice], None)

    def usage_chunk(self, usage: UsageInfo) -> dict:
        return self._body([], usage)

    def response(self) -> CompletionResponse:
        choices = []
        for i, s in enumerate(self.job.states):
            prefix = self._echo(i)
            lp = self._logprobs(s.logprobs, len(prefix), self._prompt_part(i, s.prompt_logprobs))
            choices.append(
                CompletionChoice(
                    index=i,
                    text=prefix + s.text,
                    logprobs=lp,
                    finish_reason=s.finish_reason,
                    stop_reason=s.stop_reason,
                    prompt_logprobs=vllm_prompt_logprobs(
                        s.prompt_logprobs, self.req.prompt_logprobs, self.tokenization
                    ),
                )
            )
        return CompletionResponse(
            id=self.job.request_id, model=self.model_name, choices=choices, usage=self.job.usage()
        )


def vllm_prompt_logprobs(entries: list | None, k: int | None, tokenization: Tokenization) -> list | None:
    """vLLM's prompt_logprobs field: per prompt token None or {token id: {logprob, rank, decoded_token}} with the
    k most likely tokens and the prompt's own; None unless the request asked for them (k)."""
    if k is None or entries is None:
        return None
    token_text = tokenization.token_text
    out: list = []
    for e in entries:
        if e is None:
            out.append(None)
            continue
        table = {
            str(t): PromptLogprob(logprob=_lp(lp), rank=r, decoded_token=token_text(t))
            for r, (t, lp) in enumerate(e.top[:k], start=1)
        }
        table.setdefault(
            str(e.token_id), PromptLogprob(logprob=_lp(e.logprob), rank=e.rank, decoded_token=token_text(e.token_id))
        )
        out.append(table)
    return out


def chat_chunk_json(chunk: ChatCompletionChunk) -> dict:
    """A chat chunk as OpenAI sends it: the delta carries only the fields it sets."""
    body = dump(chunk)
    for choice in body["choices"]:
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return body


def _finish_reason(reason: str | None, called: bool) -> str | None:
    """OpenAI's "tool_calls" for a reply that ended on its own with calls in it."""
    return "tool_calls" if called and reason == "stop" else reason


class ChatFormat(ResponseFormat):
    """/v1/chat/completions: assistant messages, chat logprobs, tool calls parsed out of the text."""

    def __init__(
        self,
        job: Job,
        model_name: str,
        tokenization: Tokenization,
        req: ChatCompletionRequest,
        parser: ToolParser | None,
    ):
        super().__init__(job, model_name, tokenization)
        self.req = req
        self.k = (req.top_logprobs or 0) if req.logprobs else None
        self.parser = parser  # None: the reply is plain content
        self.streams = [ToolCallStream(parser) for _ in job.states] if parser else []

    def _body(self, choices: list[ChatStreamChoice], usage: UsageInfo | None) -> dict:
        return chat_chunk_json(
            ChatCompletionChunk(
                id=self.job.request_id, created=self.created, model=self.model_name, choices=choices, usage=usage
            )
        )

    def _logprobs(self, entries: list[TokenLogprob]) -> ChatLogProbs | None:
        """Chat logprobs of generated tokens."""
        if self.k is None:
            return None
        token_text = self.tokenization.token_text
        content = []
        for e in entries:
            text = token_text(e.token_id)
            top = [(token_text(t), lp) for t, lp in e.top[: self.k]]
            content.append(
                ChatTokenLogprob(
                    token=text,
                    logprob=_lp(e.logprob),
                    bytes=list(text.encode("utf-8")),
                    top_logprobs=[TopLogprob(token=t, logprob=_lp(lp), bytes=list(t.encode("utf-8"))) for t, lp in top],
                )
            )
        return ChatLogProbs(content=content)

    def opening(self) -> list[dict]:
        usage = self.job.usage() if continuous_usage(self.req) else None
        return [
            self._body([ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content=""))], usage)
            for i in range(len(self.job.states))
        ]

    def chunk(self, d: ChoiceDelta) -> dict | None:
        lp = self._logprobs(d.logprobs or [])
        text, calls, finish = d.text, None, d.finish_reason
        if self.parser is not None:
            stream = self.streams[d.index]
            text, calls = stream.feed(d.text, d.finish_reason is not None)
            finish = _finish_reason(finish, bool(stream.ids))
        if not (text or calls or finish is not None or (lp and lp.content)):
            return None
        delta = DeltaMessage(content=text or None, tool_calls=calls or None)
        choice = ChatStreamChoice(
            index=d.index, delta=delta, logprobs=lp, finish_reason=finish, stop_reason=d.stop_reason
        )
        return self._body([choice], None)

    def usage_chunk(self, usage: UsageInfo) -> dict:
        return self._body([], usage)

    def _message(self, s: ChoiceState) -> tuple[ChatResponseMessage, str | None]:
        if self.parser is None:
            return ChatResponseMessage(content=s.text), s.finish_reason
        content, calls = ToolCallStream(self.parser, s.text).final_calls()
        return ChatResponseMessage(content=content or None, tool_calls=calls), _finish_reason(
            s.finish_reason, bool(calls)
        )

    def response(self) -> ChatCompletionResponse:
        choices = []
        for i, s in enumerate(self.job.states):
            message, finish = self._message(s)
            choices.append(
                ChatChoice(
                    index=i,
                    message=message,
                    finish_reason=finish,
                    stop_reason=s.stop_reason,
                    logprobs=self._logprobs(s.logprobs),
                )
            )
        return ChatCompletionResponse(
            id=self.job.request_id,
            model=self.model_name,
            choices=choices,
            usage=self.job.usage(),
            prompt_logprobs=vllm_prompt_logprobs(
                self.job.states[0].prompt_logprobs, self.req.prompt_logprobs, self.tokenization
            ),
        )
