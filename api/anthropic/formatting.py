"""The chat formatter's answer in Anthropic's shape: the message object, or its SSE events.

The chat message's content -> a text block, each tool call -> a tool_use block (id
toolu_..., input the parsed arguments); finish reasons stop / length / tool_calls -> end_turn
or stop_sequence (the matched sequence) / max_tokens / tool_use. Streams are the chat
formatter's chunks (api/openai/formatting.py: tool calls parsed as they stream) turned into
Anthropic's events, block by block.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from msgspec import UNSET

from api.anthropic.errors import error_body
from api.anthropic.schemas import Message, MessageUsage, TextBlock, ToolUseBlock
from api.anthropic.translate import tool_use_id
from api.openai.formatting import ChatFormatter, stream_error, usage_of
from api.openai.schemas import ChatCompletionChunk
from api.openai.serving import SETTLE
from api.openai.streaming import Generation
from api.openai.tools.plan import ToolPlan
from api.server.errors import unavailable
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class MessageFormatter:
    """The chat formatter's answer (text, tool calls, finish reasons, usage) in Anthropic's
    shape: the whole message, or its SSE events (`events(gen)`)."""

    def __init__(
        self,
        rid: str,
        model: str,
        tokenizer: Any,
        params: SamplingParams,
        tools: ToolPlan | None,
    ) -> None:
        self.id = rid
        self.model = model
        self.chat = ChatFormatter(rid, model, tokenizer, params, False, tools)
        self.stop = set(params.stop or ())

    def stop_reason(self, c: CompletionOutput, finish: str | None) -> tuple[str, str | None]:
        if finish == "tool_calls":
            return "tool_use", None
        if finish == "length":
            return "max_tokens", None
        if isinstance(c.stop_reason, str) and c.stop_reason in self.stop:
            return "stop_sequence", c.stop_reason
        return "end_turn", None

    def response(self, outputs: list[RequestOutput | None], prompts: list[list[int]]) -> Message:
        chat = self.chat.response(outputs, prompts)  # raises for an aborted or failed request
        choice = chat.choices[0]
        out = outputs[0]
        assert out is not None
        content: list[TextBlock | ToolUseBlock] = []
        if choice.message.content:
            content.append(TextBlock(text=choice.message.content))
        calls = choice.message.tool_calls if choice.message.tool_calls is not UNSET else []
        for call in calls:
            args = _arguments(call.function.arguments)
            content.append(
                ToolUseBlock(id=tool_use_id(call.id), name=call.function.name, input=args)
            )
        reason, sequence = self.stop_reason(out.outputs[0], choice.finish_reason)
        return Message(
            id=self.id,
            model=self.model,
            content=content,
            stop_reason=reason,  # type: ignore[arg-type]
            stop_sequence=sequence,
            usage=MessageUsage(
                input_tokens=chat.usage.prompt_tokens, output_tokens=chat.usage.completion_tokens
            ),
        )

    def events(self, gen: Generation) -> AsyncIterator[Any]:
        return _EventStream(self, gen).run()


_encoder = msgspec.json.Encoder()


def sse_event(kind: str, data: dict[str, Any]) -> bytes:
    """One event as Anthropic sends it: `event: <type>` then its JSON `data:` line."""
    return b"event: " + kind.encode() + b"\ndata: " + _encoder.encode(data) + b"\n\n"


def _event(data: dict[str, Any]) -> bytes:
    return sse_event(data["type"], data)


class _EventStream:
    """message_start, ping, then per content block content_block_start, its deltas
    (text_delta / input_json_delta) and content_block_stop, then message_delta (stop reason,
    usage), SETTLE and message_stop. An error after the first byte is an `error` event."""

    def __init__(self, fmt: MessageFormatter, gen: Generation) -> None:
        self.fmt = fmt
        self.gen = gen
        self.index = -1  # the open block's index
        self.open: str | None = None  # "text" | "tool_use" | None
        self.blocks: dict[int, int] = {}  # tool call index -> block index
        self.stop: tuple[str, str | None] | None = None

    async def run(self) -> AsyncIterator[Any]:
        gen, fmt = self.gen, self.fmt
        try:
            prompt_tokens = sum(len(p) for p in gen.prompts)
            message = {
                "id": fmt.id,
                "type": "message",
                "role": "assistant",
                "model": fmt.model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
            }
            yield _event({"type": "message_start", "message": message})
            yield _event({"type": "ping"})
            async for i, out in gen.updates():
                events: list[bytes] = []
                for chunk in fmt.chat.update_events(i, out, UNSET):
                    events += self._translate(chunk, out)
                if events:
                    yield b"".join(events)
            if not gen.finished or self.stop is None:
                raise unavailable("The request was aborted before it finished; retry it.", 5)
            usage = usage_of(gen.latest, gen.prompts)
            reason, sequence = self.stop
            yield _event(
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": reason, "stop_sequence": sequence},
                    "usage": {
                        "input_tokens": usage.prompt_tokens,
                        "output_tokens": usage.completion_tokens,
                    },
                }
            )
            yield SETTLE
            yield _event({"type": "message_stop"})
        except Exception as exc:  # noqa: BLE001 - after the first byte, errors travel in-band
            yield SETTLE
            yield _event(error_body(stream_error(exc)))

    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [_event({"type": "content_block_stop", "index": self.index})]

    def _start(self, kind: str, block: dict[str, Any]) -> list[bytes]:
        events = self._close()
        self.index += 1
        self.open = kind
        start = {"type": "content_block_start", "index": self.index, "content_block": block}
        return [*events, _event(start)]

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        return _event({"type": "content_block_delta", "index": index, "delta": delta})

    def _translate(self, chunk: ChatCompletionChunk, out: RequestOutput) -> list[bytes]:
        events: list[bytes] = []
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.content is not UNSET and delta.content:
            if self.open != "text":
                events += self._start("text", {"type": "text", "text": ""})
            events.append(self._delta(self.index, {"type": "text_delta", "text": delta.content}))
        for call in delta.tool_calls if delta.tool_calls is not UNSET else []:
            if call.id is not UNSET:  # a call's first delta: a new tool_use block
                block = {"type": "tool_use", "id": tool_use_id(call.id), "name": call.function.name}
                events += self._start("tool_use", {**block, "input": {}})
                self.blocks[call.index] = self.index
            args = call.function.arguments
            if args is not UNSET and args:
                partial = {"type": "input_json_delta", "partial_json": args}
                events.append(self._delta(self.blocks[call.index], partial))
        if choice.finish_reason is not None:
            events += self._close()
            self.stop = self.fmt.stop_reason(out.outputs[0], choice.finish_reason)
        return events
