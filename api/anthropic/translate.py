"""Anthropic bodies <-> the chat pipeline: a Messages request becomes a ChatCompletionRequest
(then api/openai/serving.py prepares, admits and answers it as any chat request), and the chat
formatter's output becomes Anthropic's message object or its SSE events.

Request: `system` -> a system message; text blocks -> text; an assistant's `tool_use` blocks
-> its tool_calls; a user's `tool_result` blocks -> tool messages (before the user's text);
`thinking` blocks of earlier turns are dropped; image and document blocks are refused (text-
only models). `tools` -> functions (input_schema = parameters); `tool_choice` auto / any /
tool / none -> auto / required / the named function / none, `disable_parallel_tool_use` ->
parallel_tool_calls false; `stop_sequences` -> stop; `metadata.user_id` -> the ledger's user.

Response: the chat message's content -> a text block, each tool call -> a tool_use block
(id toolu_..., input the parsed arguments); finish reasons stop / length / tool_calls ->
end_turn or stop_sequence (the matched sequence) / max_tokens / tool_use.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec
from msgspec import UNSET

from api.anthropic.errors import error_body
from api.anthropic.schemas import (
    ContentBlock,
    CountTokensRequest,
    Message,
    MessagesRequest,
    MessageUsage,
    TextBlock,
    ToolUseBlock,
)
from api.openai.formatting import ChatFormatter, stream_error, usage_of
from api.openai.schemas import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatMessage,
    FunctionCallIn,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCallIn,
    ToolDefinition,
)
from api.openai.serving import SETTLE
from api.openai.streaming import Generation
from api.openai.tools.plan import ToolPlan
from api.server.errors import invalid_request, unavailable
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

_TOOL_CHOICES = {"auto": "auto", "any": "required", "none": "none"}
_DROPPED = {"thinking", "redacted_thinking"}  # earlier turns' reasoning: no model here reads it


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


def tool_use_id(call_id: str) -> str:
    """Anthropic's id for a chat tool call's (call_XXXX -> toolu_XXXX)."""
    return "toolu_" + call_id.removeprefix("call_")


# --- request ---------------------------------------------------------------------------------


def chat_request(body: MessagesRequest | CountTokensRequest) -> ChatCompletionRequest:
    """The Messages body as the chat request it asks for (400s say what to change)."""
    if body.thinking is not None and body.thinking.type == "enabled":
        raise invalid_request("thinking: extended thinking is not supported by this server.")
    messages = chat_messages(body.system, body.messages)
    tools, tool_choice, parallel = _tools(body)
    fields: dict[str, Any] = {}
    if isinstance(body, MessagesRequest):
        fields = {
            "max_tokens": body.max_tokens,
            "stop": list(body.stop_sequences) if body.stop_sequences else None,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "top_k": body.top_k,
            "stream": body.stream,
            "user": body.metadata.user_id if body.metadata is not None else None,
        }
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        **fields,
    )


def chat_messages(system: Any, messages: list[Any]) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    if system:
        if isinstance(system, str):
            text = system
        else:
            text = "\n".join(_text_of(b, f"system[{j}]") for j, b in enumerate(system))
        out.append(ChatMessage(role="system", content=text))
    if not messages:
        raise invalid_request("messages: at least one message is required.")
    for i, m in enumerate(messages):
        if isinstance(m.content, str):
            out.append(ChatMessage(role=m.role, content=m.content))
        elif m.role == "assistant":
            out.append(_assistant(i, m.content))
        else:
            out.extend(_user(i, m.content))
    if messages[-1].role == "assistant":
        raise invalid_request(
            "messages: the last message is an assistant turn (a prefill); this server does not "
            "continue a partial assistant reply. End the conversation with a user turn."
        )
    return out


def _refuse_block(where: str, kind: str) -> None:
    if kind in ("image", "document", "search_result"):
        raise invalid_request(
            f"{where}: {kind} content blocks are not supported: this server serves text-only "
            "models. Send the content as text."
        )
    raise invalid_request(f"{where}: {kind} blocks are not accepted here.")


def _text_of(block: ContentBlock, where: str) -> str:
    if block.type != "text" or block.text is None:
        _refuse_block(where, block.type)
    return block.text or ""


def _assistant(i: int, blocks: list[ContentBlock]) -> ChatMessage:
    texts, calls = [], []
    for j, b in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if b.type == "text":
            texts.append(_text_of(b, where))
        elif b.type == "tool_use":
            if not b.id or not b.name:
                raise invalid_request(f"{where}: a tool_use block needs an id and a name.")
            calls.append(ToolCallIn(id=b.id, function=FunctionCallIn(b.name, b.input or {})))
        elif b.type not in _DROPPED:
            _refuse_block(where, b.type)
    return ChatMessage(role="assistant", content="\n".join(texts), tool_calls=calls or None)


def _user(i: int, blocks: list[ContentBlock]) -> list[ChatMessage]:
    """Tool results become tool messages, in order; the text between them user messages."""
    out: list[ChatMessage] = []
    texts: list[str] = []
    for j, b in enumerate(blocks):
        where = f"messages[{i}].content[{j}]"
        if b.type == "text":
            texts.append(_text_of(b, where))
        elif b.type == "tool_result":
            if not b.tool_use_id:
                raise invalid_request(f"{where}: a tool_result block needs its tool_use_id.")
            if texts:
                out.append(ChatMessage(role="user", content="\n".join(texts)))
                texts = []
            content = _result_text(b.content, where)
            if b.is_error:
                content = f"Error: {content}"
            out.append(ChatMessage(role="tool", content=content, tool_call_id=b.tool_use_id))
        elif b.type not in _DROPPED:
            _refuse_block(where, b.type)
    if texts or not out:
        out.append(ChatMessage(role="user", content="\n".join(texts)))
    return out


def _result_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for k, block in enumerate(content):
        kind = block.get("type")
        if kind != "text" or not isinstance(block.get("text"), str):
            _refuse_block(f"{where}.content[{k}]", str(kind))
        parts.append(block["text"])
    return "\n".join(parts)


def _tools(body: Any) -> tuple[list[ToolDefinition] | None, Any, bool | None]:
    """(tools, tool_choice, parallel_tool_calls) of the chat request."""
    tools = None
    if body.tools:
        tools = []
        for i, t in enumerate(body.tools):
            if t.type not in (None, "custom"):
                raise invalid_request(
                    f"tools[{i}]: server tools ({t.type}) are not supported; give client tools "
                    "(name, description, input_schema)."
                )
            if t.input_schema is None:
                raise invalid_request(f"tools[{i}].input_schema: a tool needs its input schema.")
            fn = FunctionDefinition(
                name=t.name, description=t.description, parameters=t.input_schema
            )
            tools.append(ToolDefinition(function=fn))
    choice = body.tool_choice
    if choice is None:
        return tools, None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if not choice.name:
            raise invalid_request('tool_choice: type "tool" needs the name of the tool.')
        return tools, NamedToolChoice(function=NamedFunction(choice.name)), parallel
    return tools, _TOOL_CHOICES[choice.type], parallel


# --- response --------------------------------------------------------------------------------


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

    def _stop_reason(self, c: CompletionOutput, finish: str | None) -> tuple[str, str | None]:
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
        reason, sequence = self._stop_reason(out.outputs[0], choice.finish_reason)
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
            self.stop = self.fmt._stop_reason(out.outputs[0], choice.finish_reason)
        return events
