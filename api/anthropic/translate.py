"""A Messages request as the ChatCompletionRequest it asks for: api/openai/serving.py then
prepares, admits and answers it as any chat request (api/anthropic/formatting.py gives the
answer Anthropic's shape).

`system` -> a system message; text blocks -> text; an assistant's `tool_use` blocks
-> its tool_calls; a user's `tool_result` blocks -> tool messages (before the user's text);
`thinking` blocks of earlier turns are dropped; image and document blocks are refused (text-
only models). `tools` -> functions (input_schema = parameters); `tool_choice` auto / any /
tool / none -> auto / required / the named function / none, `disable_parallel_tool_use` ->
parallel_tool_calls false; `stop_sequences` -> stop; `metadata.user_id` -> the ledger's user.
"""

from __future__ import annotations

import uuid
from typing import Any

from api.anthropic.schemas import (
    ContentBlock,
    CountTokensRequest,
    MessagesRequest,
)
from api.openai.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCallIn,
    FunctionDefinition,
    NamedFunction,
    NamedToolChoice,
    ToolCallIn,
    ToolDefinition,
)
from api.server.errors import invalid_request

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
