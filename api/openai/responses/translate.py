"""A Responses request as the ChatCompletionRequest it asks for: api/openai/serving.py then
prepares, admits and answers it as any chat request (api/openai/responses/formatting.py gives
the answer the Responses shape).

`instructions` -> a system message first; the conversation (a stored previous response's
input and output, then `input`) -> chat messages: message items by role (developer ->
system), content parts input_text / output_text joined; function_call items -> the
assistant's tool_calls; function_call_output items -> tool messages; reasoning items are
dropped (no model here re-reads earlier thinking). Flat function `tools` -> chat tools;
`tool_choice` auto / none / required / {"type": "function", "name"} as on chat; `text.format`
-> response_format (the grammar engine, api/openai/structured.py); max_output_tokens ->
max_tokens. What this server cannot do is a 400 naming it: hosted tools, images and files,
background mode, `include`, truncation "auto", logprobs, conversations, saved prompts.
"""

from __future__ import annotations

import uuid
from typing import Any

import msgspec

from api.openai.responses.schemas import InputContent, InputItem, ResponsesRequest
from api.openai.schemas import (
    ChatCompletionRequest,
    ChatMessage,
    FunctionCallIn,
    FunctionDefinition,
    JsonSchemaFormat,
    NamedFunction,
    NamedToolChoice,
    ResponseFormat,
    ToolCallIn,
    ToolDefinition,
)
from api.server.errors import invalid_request

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = {"input_text", "output_text", "text", "refusal"}
_TOOL_CHOICES = {"auto", "none", "required"}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_items(body: ResponsesRequest) -> list[InputItem]:
    """`input` as items (a string is one user message)."""
    if isinstance(body.input, str):
        return [InputItem(type="message", role="user", content=body.input)]
    return list(body.input)


def items_as_json(items: list[InputItem]) -> list[dict[str, Any]]:
    return msgspec.to_builtins(items)


def items_from_json(items: list[dict[str, Any]]) -> list[InputItem]:
    """Stored items (and a stored response's output items) read back as input items."""
    return msgspec.convert(items, list[InputItem])


_NULL = {"type": "null"}
# The OpenAPI schema of each field refuse_unsupported refuses: only the values it lets through
# (api/server/openapi.py puts them in the document, as for chat's refused fields).
REFUSED_FIELDS: dict[str, dict[str, Any]] = {
    "background": {"anyOf": [_NULL, {"type": "boolean", "enum": [False]}]},
    "include": {"anyOf": [_NULL, {"type": "array", "maxItems": 0}]},
    "truncation": {"anyOf": [_NULL, {"type": "string", "enum": ["disabled"]}]},
    "top_logprobs": {"anyOf": [_NULL, {"type": "integer", "enum": [0]}]},
    "conversation": _NULL,
    "prompt": _NULL,
}


def refuse_unsupported(body: ResponsesRequest) -> None:
    """400 for each field asking for something this server does not do."""
    if body.background:
        raise _unsupported("background", "background mode is not supported; omit `background`")
    if body.include:
        raise _unsupported("include", f"include ({', '.join(body.include)}) is not supported")
    if body.truncation not in (None, "disabled"):
        raise _unsupported(
            "truncation",
            'truncation "auto" is not supported: a conversation longer than the context is a '
            "400; shorten it",
        )
    if body.top_logprobs is not None and body.top_logprobs != 0:
        raise _unsupported("top_logprobs", "logprobs are not supported on /v1/responses")
    if body.conversation is not None:
        raise _unsupported("conversation", "conversations are not supported; use "
                           "previous_response_id")  # fmt: skip
    if body.prompt is not None:
        raise _unsupported("prompt", "saved prompts are not supported")


def _unsupported(param: str, why: str) -> Exception:
    return invalid_request(f"{param}: {why}.", param, code="unsupported_parameter")


def chat_request(body: ResponsesRequest, history: list[InputItem]) -> ChatCompletionRequest:
    """The chat request for `body`, its conversation being `history` (the stored earlier
    items, then this request's input)."""
    refuse_unsupported(body)
    messages: list[ChatMessage] = []
    if body.instructions:
        messages.append(ChatMessage(role="system", content=body.instructions))
    messages += chat_messages(history)
    tools, tool_choice = _tools(body)
    return ChatCompletionRequest(
        model=body.model,
        messages=messages,
        max_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stream=body.stream,
        user=body.user,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=body.parallel_tool_calls,
        response_format=_response_format(body),
    )


def chat_messages(items: list[InputItem]) -> list[ChatMessage]:
    if not items:
        raise invalid_request("input: give at least one input item.", "input")
    out: list[ChatMessage] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.type or "message"
        if kind == "message":
            role = _ROLES.get(item.role or "")
            if role is None:
                raise invalid_request(
                    f"{where}.role must be user, assistant, system or developer; "
                    f"got {item.role!r}.",
                    "input",
                )
            out.append(ChatMessage(role=role, content=_text(item.content, f"{where}.content")))
        elif kind == "function_call":
            if not item.call_id or not item.name:
                raise invalid_request(f"{where}: a function_call needs call_id and name.", "input")
            call = ToolCallIn(
                id=item.call_id, function=FunctionCallIn(item.name, item.arguments or "{}")
            )
            last = out[-1] if out else None
            if last is not None and last.role == "assistant" and _last_was_call(items, i):
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                out.append(ChatMessage(role="assistant", content="", tool_calls=[call]))
        elif kind == "function_call_output":
            if not item.call_id:
                raise invalid_request(f"{where}: a function_call_output needs call_id.", "input")
            text = _text(item.output, f"{where}.output")
            out.append(ChatMessage(role="tool", content=text, tool_call_id=item.call_id))
        elif kind != "reasoning":
            raise invalid_request(
                f"{where}: {kind} items are not supported; give message, function_call and "
                "function_call_output items.",
                "input",
            )
    return out


def _last_was_call(items: list[InputItem], i: int) -> bool:
    """Whether the function_call at i follows an assistant turn (a message or another call):
    one assistant turn's calls form one chat message."""
    prev = next((it for it in reversed(items[:i]) if it.type != "reasoning"), None)
    if prev is None:
        return False
    return prev.type == "function_call" or (
        prev.type in (None, "message") and prev.role == "assistant"
    )


def _text(content: str | list[InputContent] | None, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.type not in _TEXT_PARTS or part.text is None:
            raise invalid_request(
                f"{where}[{j}]: {part.type} content is not supported: this server serves "
                "text-only models. Send the content as input_text.",
                "input",
            )
        parts.append(part.text)
    return "".join(parts)


def _tools(body: ResponsesRequest) -> tuple[list[ToolDefinition] | None, Any]:
    tools = None
    if body.tools:
        hosted = [t.type for t in body.tools if t.type != "function"]
        if hosted:
            raise invalid_request(
                f"tools: {', '.join(dict.fromkeys(hosted))} tools are not supported; this "
                'server runs function tools only ({"type": "function", "name", "parameters"}).',
                "tools",
            )
        tools = []
        for i, t in enumerate(body.tools):
            if not t.name:
                raise invalid_request(f"tools[{i}]: a function tool needs its name.", "tools")
            fn = FunctionDefinition(
                name=t.name, description=t.description, parameters=t.parameters, strict=t.strict
            )
            tools.append(ToolDefinition(function=fn))
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        if choice is not None and choice not in _TOOL_CHOICES:
            raise invalid_request(
                f"tool_choice must be auto, none, required or a function; got {choice!r}.",
                "tool_choice",
            )
        return tools, choice
    if choice.type != "function":
        raise invalid_request(
            f"tool_choice: {choice.type} is not supported; name a function "
            '({"type": "function", "name": ...}) or give auto, none or required.',
            "tool_choice",
        )
    if not choice.name:
        raise invalid_request('tool_choice: type "function" needs the name.', "tool_choice")
    return tools, NamedToolChoice(function=NamedFunction(choice.name))


def _response_format(body: ResponsesRequest) -> ResponseFormat | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ResponseFormat(type="json_object")
    if fmt.schema is None:
        raise invalid_request("text.format: json_schema needs its schema.", "text.format.schema")
    js = JsonSchemaFormat(
        name=fmt.name, description=fmt.description, schema=fmt.schema, strict=fmt.strict
    )
    return ResponseFormat(type="json_schema", json_schema=js)
