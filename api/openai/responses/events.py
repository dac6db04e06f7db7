"""A Responses stream: the chat formatter's chunks (api/openai/formatting.py: reasoning split
and tool calls parsed as they stream) turned into OpenAI's typed SSE events, item by item,
each with `type` and `sequence_number` and an `event:` line naming it:

    response.created, response.in_progress,
    per item: response.output_item.added,
        message:   content_part.added, output_text.delta*, output_text.done, content_part.done
        reasoning: content_part.added, reasoning_text.delta*, reasoning_text.done, content_part.done
        call:      function_call_arguments.delta*, function_call_arguments.done
      response.output_item.done,
    response.completed (or response.incomplete: the output hit max_output_tokens).

The request is settled (usage row, quota) and the response stored before the last event. An
error after the first byte is an `error` event.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec
from msgspec import UNSET

from api.openai.formatting import stream_error, usage_of
from api.openai.responses.schemas import (
    FunctionCallItem,
    OutputItem,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
)
from api.openai.responses.translate import new_id
from api.openai.schemas import ChatCompletionChunk
from api.openai.serving import SETTLE
from api.openai.streaming import Generation
from api.server.errors import unavailable

if TYPE_CHECKING:
    from api.openai.responses.formatting import ResponseFormatter

_encoder = msgspec.json.Encoder()


def sse_event(data: dict[str, Any]) -> bytes:
    """One event as OpenAI sends it: `event: <type>` then its JSON `data:` line."""
    return b"event: " + data["type"].encode() + b"\ndata: " + _encoder.encode(data) + b"\n\n"


class _Open:
    """The output item being streamed: its index, kind and text (or arguments) so far."""

    def __init__(self, index: int, item: OutputItem) -> None:
        self.index = index
        self.item = item
        self.text = ""


class EventStream:
    def __init__(
        self,
        fmt: ResponseFormatter,
        gen: Generation,
        on_done: Callable[[ResponseObject], Awaitable[None]],
    ) -> None:
        self.fmt = fmt
        self.gen = gen
        self.on_done = on_done
        self.seq = 0
        self.items: list[OutputItem] = []
        self.open: _Open | None = None
        self.calls: dict[int, _Open] = {}  # chat tool-call index -> its item
        self.finish: str | None = None
        self.thinking = ""

    def _event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse_event(msgspec.to_builtins(data))

    async def run(self) -> AsyncIterator[Any]:
        gen, fmt = self.gen, self.fmt
        settled = False
        try:
            start = fmt.shell("in_progress", [], None)
            yield self._event("response.created", response=start) + self._event(
                "response.in_progress", response=start
            )
            async for i, out in gen.updates():
                events: list[bytes] = []
                for chunk in fmt.chat.update_events(i, out, UNSET):
                    events += self._translate(chunk)
                if events:
                    yield b"".join(events)
            if not gen.finished or self.finish is None:
                raise unavailable("The request was aborted before it finished; retry it.", 5)
            usage = fmt.usage(usage_of(gen.latest, gen.prompts), self.thinking)
            final = fmt.shell("completed", self.items, usage, self.finish)
            settled = True
            yield SETTLE
            await self.on_done(final)
            kind = "response.incomplete" if final.status == "incomplete" else "response.completed"
            yield self._event(kind, response=final)
        except Exception as exc:  # noqa: BLE001 - after the first byte, errors travel in-band
            if not settled:
                yield SETTLE
            err = stream_error(exc)
            yield self._event("error", code=err.code, message=err.message, param=err.param)

    # --- opening and closing items -------------------------------------------------------

    def _add(self, item: OutputItem) -> tuple[_Open, list[bytes]]:
        events = self._close()
        opened = _Open(len(self.items), item)
        self.items.append(item)
        self.open = opened
        return opened, [
            *events,
            self._event("response.output_item.added", output_index=opened.index, item=item),
        ]

    def _part(self, opened: _Open, part: dict[str, Any], kind: str = "added") -> bytes:
        return self._event(
            f"response.content_part.{kind}",
            item_id=opened.item.id,
            output_index=opened.index,
            content_index=0,
            part=part,
        )

    def _close(self) -> list[bytes]:
        opened, self.open = self.open, None
        if opened is None:
            return []
        item, where = opened.item, {"item_id": opened.item.id, "output_index": opened.index}
        events: list[bytes] = []
        if isinstance(item, ReasoningItem):
            item.content = [ReasoningText(text=opened.text)]
            events.append(
                self._event(
                    "response.reasoning_text.done", **where, content_index=0, text=opened.text
                )
            )
            events.append(
                self._part(opened, {"type": "reasoning_text", "text": opened.text}, "done")
            )
        elif isinstance(item, OutputMessage):
            item.status = "incomplete" if self.finish == "length" else "completed"
            item.content = [OutputText(text=opened.text)]
            events.append(
                self._event(
                    "response.output_text.done",
                    **where,
                    content_index=0,
                    text=opened.text,
                    logprobs=[],
                )
            )
            events.append(self._part(opened, item.content[0], "done"))
        else:
            item.arguments = opened.text
            item.status = "completed"
            events.append(
                self._event(
                    "response.function_call_arguments.done",
                    **where,
                    name=item.name,
                    arguments=opened.text,
                )
            )
        events.append(
            self._event("response.output_item.done", output_index=opened.index, item=item)
        )
        return events

    # --- chat chunks -> events -----------------------------------------------------------

    def _translate(self, chunk: ChatCompletionChunk) -> list[bytes]:
        events: list[bytes] = []
        choice = chunk.choices[0]
        delta = choice.delta
        if delta.reasoning_content is not UNSET and delta.reasoning_content:
            opened = self.open
            if opened is None or not isinstance(opened.item, ReasoningItem):
                item = ReasoningItem(id=new_id("rs"), content=[], status="in_progress")
                opened, added = self._add(item)
                events += [*added, self._part(opened, {"type": "reasoning_text", "text": ""})]
            opened.text += delta.reasoning_content
            self.thinking += delta.reasoning_content
            events.append(
                self._event(
                    "response.reasoning_text.delta",
                    item_id=opened.item.id,
                    output_index=opened.index,
                    content_index=0,
                    delta=delta.reasoning_content,
                )
            )
        if delta.content is not UNSET and delta.content:
            opened = self.open
            if opened is None or not isinstance(opened.item, OutputMessage):
                item = OutputMessage(id=new_id("msg"), status="in_progress", content=[])
                opened, added = self._add(item)
                events += [*added, self._part(opened, OutputText(text=""))]
            opened.text += delta.content
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=opened.item.id,
                    output_index=opened.index,
                    content_index=0,
                    delta=delta.content,
                    logprobs=[],
                )
            )
        for call in delta.tool_calls if delta.tool_calls is not UNSET else []:
            if call.id is not UNSET:  # a call's first delta: a new function_call item
                name = call.function.name if call.function.name is not UNSET else ""
                item = FunctionCallItem(
                    id=new_id("fc"), call_id=call.id, name=name, arguments="", status="in_progress"
                )
                opened, added = self._add(item)
                self.calls[call.index] = opened
                events += added
            opened = self.calls[call.index]
            args = call.function.arguments
            if args is not UNSET and args:
                opened.text += args
                events.append(
                    self._event(
                        "response.function_call_arguments.delta",
                        item_id=opened.item.id,
                        output_index=opened.index,
                        delta=args,
                    )
                )
        if choice.finish_reason is not None:
            self.finish = choice.finish_reason
            events += self._close()
            if not self.items:  # nothing was said: one empty message, as the whole answer has
                opened, added = self._add(
                    OutputMessage(id=new_id("msg"), status="in_progress", content=[])
                )
                events += [*added, self._part(opened, OutputText(text="")), *self._close()]
        return events
