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

from api.openai.reasoning import ReasoningSplit
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
    PromptLogprob,
    PromptTokensDetails,
    ToolCall,
    TopLogprob,
    Usage,
)
from api.openai.streaming import SETTLE, SSE_DONE, Generation, sse_event
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


def check_complete(outputs: list[RequestOutput | None]) -> None:
    """Raise the error of an output the engine did not finish (aborted, failed, timed out)."""
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

    def _new(
        self, index: int, c: CompletionOutput, text: str | None = None
    ) -> tuple[str, list[TokenLogprobs] | None]:
        """The text (c.text, or the part of it given) and logprobs of choice `index` not sent
        yet; marks them sent."""
        text = c.text if text is None else text
        sent = self._sent_text.get(index, 0)
        delta = text[sent:] if len(text) > sent else ""
        self._sent_text[index] = max(sent, len(text))
        lps = None
        if c.logprobs is not None:
            k = self._sent_tokens.get(index, 0)
            lps = c.logprobs[k:]
            self._sent_tokens[index] = len(c.logprobs)
        return delta, lps


class ChatFormatter(_Formatter):
    """`tools`: the request's ToolPlan; each choice's text is then read for tool calls (as
    it streams, too) and a reply that calls tools ends with finish_reason "tool_calls".
    `reasoning`: the think section is split off first (`reasoning_content`); the content and
    the tool calls are read from what follows it."""

    def __init__(
        self,
        rid: str,
        model: str,
        tokenizer: Any,
        params: SamplingParams,
        logprobs: bool,
        tools: ToolPlan | None = None,
        reasoning: ReasoningSplit | None = None,
    ) -> None:
        super().__init__(rid, model, tokenizer, params)
        self.want_logprobs = logprobs
        self.want_prompt_logprobs = params.prompt_logprobs is not None
        self.tools = tools if tools is not None and tools.active else None
        self.reasoning = reasoning
        self._streamers: dict[int, ToolStreamer] = {}
        self._sent_reasoning: dict[int, int] = {}  # choice index -> reasoning characters sent

    def _split(self, text: str, final: bool) -> tuple[str | None, str]:
        """(reasoning to show, the answer's text) of a choice's output so far."""
        if self.reasoning is None:
            return None, text
        thinking, answer = self.reasoning.split(text, final)
        return (thinking if self.reasoning.include else None), answer

    def _streamer(self, index: int) -> ToolStreamer:
        streamer = self._streamers.get(index)
        if streamer is None:
            assert self.tools is not None
            streamer = self._streamers[index] = self.tools.streamer()
        return streamer

    def _message(self, c: CompletionOutput) -> tuple[ChatResponseMessage, str | None]:
        thinking, text = self._split(c.text, final=True)
        extra = {} if thinking is None else {"reasoning_content": thinking}
        if self.reasoning is not None and not text:
            text = None  # all thinking (cut off by max_tokens): no answer, not an empty one
        if self.tools is None or text is None:
            return ChatResponseMessage(content=text, **extra), c.finish_reason
        content, calls = self._streamer(c.index).parse(text)
        if not calls:
            return ChatResponseMessage(content=content, **extra), c.finish_reason
        tool_calls = [ToolCall(id=t.id, function=FunctionCall(t.name, t.arguments)) for t in calls]
        message = ChatResponseMessage(content=content, tool_calls=tool_calls, **extra)
        return message, _finish(c, True)

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
        check_complete(outputs)
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
            prompt_logprobs=vllm_prompt_logprobs(self, out) if self.want_prompt_logprobs else UNSET,
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
            finish = c.finish_reason
            thinking, text = self._split(c.text, final=finish is not None)
            delta, lps = self._new(c.index, c, text)
            deltas = []
            if thinking is not None:
                sent = self._sent_reasoning.get(c.index, 0)
                if len(thinking) > sent:
                    deltas.append(DeltaMessage(reasoning_content=thinking[sent:]))
                    self._sent_reasoning[c.index] = len(thinking)
            if self.tools is not None:
                streamer = self._streamer(c.index)
                deltas += [_delta(d) for d in streamer.update(text, final=finish is not None)]
                if finish is not None:
                    finish = _finish(c, streamer.called)
            elif delta:
                deltas.append(DeltaMessage(content=delta))
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


_FROM_PARAMS: Any = object()


class CompletionFormatter(_Formatter):
    """Completions. `echo`: each prompt's text, put before its choices' text; with `logprobs`
    the prompt's tokens come first in the choice's logprobs (the first one's null), as
    OpenAI's legacy completions and vLLM do. `echo_only` (echo with max_tokens 0): the
    choice is the prompt alone (the one token the engine generated is left out). `n`: the
    choices per prompt; the engine's params.n may be more (best_of): then the n samples of
    highest cumulative logprob are returned. `prompt_logprobs`: vLLM's field on each choice.
    """

    def __init__(
        self,
        rid: str,
        model: str,
        tokenizer: Any,
        params: SamplingParams,
        echo: list[str] | None,
        *,
        n: int | None = None,
        logprobs: Any = _FROM_PARAMS,
        echo_only: bool = False,
        prompt_logprobs: bool = False,
    ) -> None:
        super().__init__(rid, model, tokenizer, params)
        if n is not None:
            self.n = n
        self.best_of = params.n
        # the body's logprobs: the engine's may be set for best_of alone
        self.want_logprobs = (params.logprobs if logprobs is _FROM_PARAMS else logprobs) is not None
        self.echo = echo
        self.echo_only = echo_only
        self.want_prompt_logprobs = prompt_logprobs
        self._offset: dict[int, int] = {}  # choice index -> text offset of its next token
        self._started: set[int] = set()  # choices whose first chunk went out (streaming)

    def _logprobs(self, index: int, lps: list[TokenLogprobs] | None) -> CompletionLogprobs | None:
        if not self.want_logprobs or lps is None:
            return None
        tokens, values, tops, offsets = [], [], [], []
        offset = self._offset.get(index, 0)
        for lp in lps:
            text = self.token_text(lp.token_id)
            tokens.append(text)
            values.append(lp.logprob)
            top: dict[str, float] = {}
            for tid, v in lp.top:  # tokens that read the same (byte pieces): the likelier one
                top.setdefault(self.token_text(tid), v)
            tops.append(top)
            offsets.append(offset)
            offset += len(text)
        self._offset[index] = offset
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=values, top_logprobs=tops, text_offset=offsets
        )

    def _echo_logprobs(self, index: int, out: RequestOutput) -> CompletionLogprobs | None:
        """The prompt's part of an echoed choice's logprobs: its first token has none."""
        if not self.want_logprobs:
            return None
        entries = out.prompt_logprobs or [None]
        first = self.token_text(out.prompt_token_ids[0]) if out.prompt_token_ids else ""
        self._offset[index] = len(first)
        rest = self._logprobs(index, [e for e in entries[1:] if e is not None])
        assert rest is not None
        return CompletionLogprobs(
            tokens=[first, *rest.tokens],
            token_logprobs=[None, *rest.token_logprobs],
            top_logprobs=[None, *rest.top_logprobs],
            text_offset=[0, *rest.text_offset],
        )

    def _prompt_logprobs(self, out: RequestOutput) -> Any:
        if not self.want_prompt_logprobs:
            return UNSET
        return vllm_prompt_logprobs(self, out)

    def _chosen(self, out: RequestOutput) -> list[CompletionOutput]:
        """The n choices of one prompt: all its samples, or with best_of the n of highest
        cumulative logprob (most likely first)."""
        samples = sorted(out.outputs, key=lambda c: c.index)
        if len(samples) <= self.n:
            return samples
        return sorted(samples, key=lambda c: -(c.cumulative_logprob or 0.0))[: self.n]

    def _merge(
        self, head: CompletionLogprobs | None, tail: CompletionLogprobs | None
    ) -> CompletionLogprobs | None:
        if head is None or tail is None:
            return head or tail
        return CompletionLogprobs(
            tokens=head.tokens + tail.tokens,
            token_logprobs=head.token_logprobs + tail.token_logprobs,
            top_logprobs=head.top_logprobs + tail.top_logprobs,
            text_offset=head.text_offset + tail.text_offset,
        )

    def response(
        self, outputs: list[RequestOutput | None], prompts: list[list[int]]
    ) -> CompletionResponse:
        check_complete(outputs)
        choices = []
        for i, out in enumerate(outputs):
            assert out is not None
            for k, c in enumerate(self._chosen(out)):
                index = i * self.n + k
                prefix = self.echo[i] if self.echo else ""
                head = self._echo_logprobs(index, out) if self.echo else None
                if self.echo_only:
                    text, lps = prefix, head
                else:
                    text, lps = (
                        prefix + c.text,
                        self._merge(head, self._logprobs(index, c.logprobs)),
                    )
                choices.append(
                    CompletionChoice(
                        index=index,
                        text=text,
                        logprobs=lps,
                        finish_reason=c.finish_reason,
                        prompt_logprobs=self._prompt_logprobs(out),
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

    def _waits_for_prompt(self) -> bool:
        """Whether a choice's first chunk needs the engine's first output (prompt logprobs)."""
        return self.want_prompt_logprobs or (bool(self.echo) and self.want_logprobs)

    def start_events(self, usage: Any) -> list[Any]:
        if not self.echo or self._waits_for_prompt():
            return []
        events = []
        for i, text in enumerate(self.echo):
            for k in range(self.n):
                self._started.add(i * self.n + k)
                events.append(
                    self._chunk(CompletionChoice(i * self.n + k, text, None, None), usage)
                )
        return events

    def update_events(self, prompt: int, out: RequestOutput, usage: Any) -> list[Any]:
        events = []
        for c in out.outputs:  # streamed: n == best_of (best_of > n cannot stream)
            index = prompt * self.n + c.index
            if index in self._done:
                continue
            _check_finish(c)
            if index not in self._started:  # the echo and the prompt's logprobs come first
                self._started.add(index)
                text = self.echo[prompt] if self.echo else ""
                head = self._echo_logprobs(index, out) if self.echo else None
                if text or head is not None or self.want_prompt_logprobs:
                    choice = CompletionChoice(
                        index, text, head, None, prompt_logprobs=self._prompt_logprobs(out)
                    )
                    events.append(self._chunk(choice, usage))
            if self.echo_only:
                delta, lps = "", None
            else:
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


def vllm_prompt_logprobs(fmt: _Formatter, out: RequestOutput) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt position (the first is null) a dict keyed by token
    id (as a string): the prompt token's logprob, rank and text, then the top alternatives'."""
    entries = out.prompt_logprobs or [None]
    result: list[dict | None] = [None]
    for e in entries[1:]:
        if e is None:
            result.append(None)
            continue
        d = {str(e.token_id): PromptLogprob(e.logprob, e.rank, fmt.token_text(e.token_id))}
        for rank, (tid, v) in enumerate(e.top, start=1):
            d.setdefault(str(tid), PromptLogprob(v, rank, fmt.token_text(tid)))
        result.append(d)
    return result


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


async def sse_stream(gen: Generation, fmt: Any, include_usage: bool) -> AsyncIterator[Any]:
    """The SSE body of a streaming request (bytes, and SETTLE before the final `[DONE]`).
    `gen` was admitted already (`start` succeeded)."""
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
    yield SETTLE
    yield SSE_DONE
