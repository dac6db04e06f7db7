"""Engine outputs -> OpenAI bodies: whole responses and SSE chunks, for chat and completions.

The engine's RequestOutputs are cumulative; a formatter remembers how much of each choice it
has sent and turns the rest into deltas. Streams follow OpenAI's order: (chat) a role delta
per choice, content deltas, a finish chunk per choice, the usage chunk if asked, [DONE]. An
error after the first byte is an SSE `data: {"error": ...}` event, then [DONE]. With tools
(api/openai/tools/plan.py) each chat choice's text goes through a ToolStreamer: calls become
`tool_calls` (whole) or OpenAI's tool-call deltas (streamed), the same either way.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from msgspec import UNSET

from api.openai.schemas import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatResponseMessage,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionChunk,
    CompletionLogprobs,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    PromptTokensDetails,
    ToolCall,
    TopLogprob,
    Usage,
)
from api.openai.streaming import SSE_DONE, Generation, sse_event
from api.openai.tools import ToolStreamer
from api.openai.tools.base import Delta
from api.openai.tools.plan import ToolPlan
from api.server.errors import APIError, invalid_request, request_timed_out, unavailable
from engine.errors import EngineDeadError, QueueFullError
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprobs
from engine.sampling_params import SamplingParams

logger = logging.getLogger("tessera.api")


def usage_of(outputs: list[RequestOutput | None], prompts: list[list[int]]) -> Usage:
    prompt_tokens = sum(len(p) for p in prompts)
    completion = sum(len(c.token_ids) for o in outputs if o is not None for c in o.outputs)
    cached = sum(o.num_cached_tokens for o in outputs if o is not None)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion,
        total_tokens=prompt_tokens + completion,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
    )


def _check_finish(c: CompletionOutput) -> None:
    """finish_reason abort/error/timeout are not OpenAI's: they end the request with an error."""
    if c.finish_reason == "abort":
        raise unavailable("The request was aborted (the server is shutting down); retry it.", 5)
    if c.finish_reason == "error":
        raise APIError(500, "The engine failed while running this request.", "server_error")
    if c.finish_reason == "timeout":
        raise request_timed_out()


def _check_complete(outputs: list[RequestOutput | None]) -> None:
    for o in outputs:
        if o is None or not o.finished:
            raise unavailable("The request was aborted before it finished; retry it.", 5)
        if o.error:
            raise APIError(500, f"The engine failed: {o.error}", "server_error")
        for c in o.outputs:
            _check_finish(c)


class _Formatter:
    def __init__(self, rid: str, model: str, tokenizer: Any, params: SamplingParams) -> None:
        self.id = rid
        self.model = model
        self.tokenizer = tokenizer
        self.n = params.n
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        self._sent_text: dict[int, int] = {}  # choice index -> characters sent
        self._sent_tokens: dict[int, int] = {}  # choice index -> tokens whose logprobs were sent
        self._done: set[int] = set()

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text

    def _new(self, index: int, c: CompletionOutput) -> tuple[str, list[TokenLogprobs] | None]:
        """The text and logprobs of choice `index` not sent yet; marks them sent."""
        sent = self._sent_text.get(index, 0)
        delta = c.text[sent:] if len(c.text) > sent else ""
        self._sent_text[index] = max(sent, len(c.text))
        lps = None
        if c.logprobs is not None:
            k = self._sent_tokens.get(index, 0)
            lps = c.logprobs[k:]
            self._sent_tokens[index] = len(c.logprobs)
        return delta, lps


class ChatFormatter(_Formatter):
    """`tools`: the request's ToolPlan; each choice's text is then read for tool calls (as
    it streams, too) and a reply that calls tools ends with finish_reason "tool_calls"."""

    def __init__(
        self,
        rid: str,
        model: str,
        tokenizer: Any,
        params: SamplingParams,
        logprobs: bool,
        tools: ToolPlan | None = None,
    ) -> None:
        super().__init__(rid, model, tokenizer, params)
        self.want_logprobs = logprobs
        self.tools = tools if tools is not None and tools.active else None
        self._streamers: dict[int, ToolStreamer] = {}

    def _streamer(self, index: int) -> ToolStreamer:
        streamer = self._streamers.get(index)
        if streamer is None:
            assert self.tools is not None
            streamer = self._streamers[index] = self.tools.streamer()
        return streamer

    def _message(self, c: CompletionOutput) -> tuple[ChatResponseMessage, str | None]:
        if self.tools is None:
            return ChatResponseMessage(content=c.text), c.finish_reason
        content, calls = self._streamer(c.index).parse(c.text)
        if not calls:
            return ChatResponseMessage(content=content), c.finish_reason
        tool_calls = [ToolCall(id=t.id, function=FunctionCall(t.name, t.arguments)) for t in calls]
        return ChatResponseMessage(content=content, tool_calls=tool_calls), _finish(c, True)

    def _logprobs(self, lps: list[TokenLogprobs] | None) -> ChatLogprobs | None:
        if not self.want_logprobs or lps is None:
            return None
        content = []
        for lp in lps:
            text = self.token_text(lp.token_id)
            top = [
                TopLogprob(token=(t := self.token_text(tid)), logprob=v, bytes=list(t.encode()))
                for tid, v in lp.top
            ]
            content.append(
                ChatTokenLogprob(
                    token=text, logprob=lp.logprob, bytes=list(text.encode()), top_logprobs=top
                )
            )
        return ChatLogprobs(content=content)

    def response(
        self, outputs: list[RequestOutput | None], prompts: list[list[int]]
    ) -> ChatCompletionResponse:
        _check_complete(outputs)
        out = outputs[0]
        assert out is not None
        choices = [
            ChatChoice(
                index=c.index,
                message=message,
                logprobs=self._logprobs(c.logprobs),
                finish_reason=finish,
            )
            for c in sorted(out.outputs, key=lambda c: c.index)
            for message, finish in [self._message(c)]
        ]
        return ChatCompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage_of(outputs, prompts),
        )

    def _chunk(self, choice: ChatChunkChoice, usage: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage
        )

    def start_events(self, usage: Any) -> list[Any]:
        return [
            self._chunk(ChatChunkChoice(i, DeltaMessage(role="assistant", content="")), usage)
            for i in range(self.n)
        ]

    def update_events(self, _prompt: int, out: RequestOutput, usage: Any) -> list[Any]:
        events = []
        for c in out.outputs:
            if c.index in self._done:
                continue
            _check_finish(c)
            delta, lps = self._new(c.index, c)
            finish = c.finish_reason
            if self.tools is not None:
                streamer = self._streamer(c.index)
                deltas = [_delta(d) for d in streamer.update(c.text, final=finish is not None)]
                if finish is not None:
                    finish = _finish(c, streamer.called)
            else:
                deltas = [DeltaMessage(content=delta)] if delta else []
            if lps and not deltas:
                deltas = [DeltaMessage()]
            for k, d in enumerate(deltas):
                logprobs = self._logprobs(lps) if k == 0 else None
                events.append(self._chunk(ChatChunkChoice(c.index, d, logprobs=logprobs), usage))
            if finish is not None:
                self._done.add(c.index)
                events.append(
                    self._chunk(
                        ChatChunkChoice(c.index, DeltaMessage(), finish_reason=finish), usage
                    )
                )
        return events

    def usage_event(self, usage: Usage) -> ChatCompletionChunk:
        return ChatCompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )


def _finish(c: CompletionOutput, called: bool) -> str | None:
    """A reply that called tools and ended by itself finishes with "tool_calls"."""
    return "tool_calls" if called and c.finish_reason == "stop" else c.finish_reason


def _delta(d: Delta) -> DeltaMessage:
    if not d.calls:
        return DeltaMessage(content=d.content)
    calls = []
    for call in d.calls:
        if call.id is not None:  # a call's first delta: id, type, name and arguments ""
            fn = DeltaFunctionCall(name=call.name, arguments=call.arguments)
            calls.append(DeltaToolCall(index=call.index, id=call.id, type="function", function=fn))
        else:
            fn = DeltaFunctionCall(arguments=call.arguments)
            calls.append(DeltaToolCall(index=call.index, function=fn))
    return DeltaMessage(tool_calls=calls)


class CompletionFormatter(_Formatter):
    def __init__(
        self,
        rid: str,
        model: str,
        tokenizer: Any,
        params: SamplingParams,
        echo: list[str] | None,
    ) -> None:
        super().__init__(rid, model, tokenizer, params)
        self.want_logprobs = params.logprobs is not None
        self.echo = echo
        self._offset: dict[int, int] = {}  # choice index -> text offset of its next token

    def _logprobs(self, index: int, lps: list[TokenLogprobs] | None) -> CompletionLogprobs | None:
        if not self.want_logprobs or lps is None:
            return None
        tokens, values, tops, offsets = [], [], [], []
        offset = self._offset.get(index, 0)
        for lp in lps:
            text = self.token_text(lp.token_id)
            tokens.append(text)
            values.append(lp.logprob)
            tops.append({self.token_text(tid): v for tid, v in lp.top})
            offsets.append(offset)
            offset += len(text)
        self._offset[index] = offset
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets
        )

    def response(
        self, outputs: list[RequestOutput | None], prompts: list[list[int]]
    ) -> CompletionResponse:
        _check_complete(outputs)
        choices = []
        for i, out in enumerate(outputs):
            assert out is not None
            for c in sorted(out.outputs, key=lambda c: c.index):
                prefix = self.echo[i] if self.echo else ""
                choices.append(
                    CompletionChoice(
                        index=i * self.n + c.index,
                        text=prefix + c.text,
                        logprobs=self._logprobs(i * self.n + c.index, c.logprobs),
                        finish_reason=c.finish_reason,
                    )
                )
        return CompletionResponse(
            id=self.id,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage_of(outputs, prompts),
        )

    def _chunk(self, choice: CompletionChoice, usage: Any) -> CompletionChunk:
        return CompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[choice], usage=usage
        )

    def start_events(self, usage: Any) -> list[Any]:
        if not self.echo:
            return []
        return [
            self._chunk(CompletionChoice(i * self.n + k, text, None, None), usage)
            for i, text in enumerate(self.echo)
            for k in range(self.n)
        ]

    def update_events(self, prompt: int, out: RequestOutput, usage: Any) -> list[Any]:
        events = []
        for c in out.outputs:
            index = prompt * self.n + c.index
            if index in self._done:
                continue
            _check_finish(c)
            delta, lps = self._new(index, c)
            if delta or lps or c.finish_reason is not None:
                if c.finish_reason is not None:
                    self._done.add(index)
                events.append(
                    self._chunk(
                        CompletionChoice(index, delta, self._logprobs(index, lps), c.finish_reason),
                        usage,
                    )
                )
        return events

    def usage_event(self, usage: Usage) -> CompletionChunk:
        return CompletionChunk(
            id=self.id, created=self.created, model=self.model, choices=[], usage=usage
        )


def stream_error(exc: BaseException) -> APIError:
    """The error a stream that already started ends with, in-band."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, QueueFullError | EngineDeadError):
        return unavailable(f"The engine stopped serving this request: {exc}")
    if isinstance(exc, ValueError):
        return invalid_request(str(exc))
    logger.exception("Stream failed", exc_info=exc)
    return APIError(500, "Internal error while streaming.", "server_error")


def error_body(exc: BaseException) -> dict:
    return stream_error(exc).to_body()


async def sse_stream(gen: Generation, fmt: Any, include_usage: bool) -> AsyncIterator[bytes]:
    """The SSE body of a streaming request. `gen` was admitted already (`start` succeeded)."""
    usage = None if include_usage else UNSET
    try:
        events = fmt.start_events(usage)
        if events:
            yield b"".join(sse_event(e) for e in events)
        async for i, out in gen.updates():
            events = fmt.update_events(i, out, usage)
            if events:
                yield b"".join(sse_event(e) for e in events)
        if not gen.finished:
            raise unavailable("The request was aborted before it finished; retry it.", 5)
        if include_usage:
            yield sse_event(fmt.usage_event(usage_of(gen.latest, gen.prompts)))
    except Exception as exc:  # noqa: BLE001 - after the first byte, errors travel in-band
        yield sse_event(error_body(exc))
    yield SSE_DONE
