"""Anthropic Messages API wire format: request and response bodies as msgspec Structs.

Field names and nesting follow Anthropic's API. The request bodies refuse unknown top-level
fields (as Anthropic does: "Extra inputs are not permitted"); content blocks are one Struct
whose `type` says which fields count, so that a block this server cannot take (an image, a
document) is refused by api/anthropic/translate.py with a message that says so. Fields
Anthropic defines and this server leaves without effect (`cache_control`, `citations`,
`service_tier`) are accepted and ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Struct

BlockType = Literal[
    "text",
    "image",
    "document",
    "search_result",
    "tool_use",
    "tool_result",
    "thinking",
    "redacted_thinking",
    "server_tool_use",
    "web_search_tool_result",
]

# --- requests ------------------------------------------------------------------------------


class ContentBlock(Struct, kw_only=True):
    """One block of a message's content (or of a tool result's)."""

    type: BlockType
    text: str | None = None  # text
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None  # tool_result: text or blocks
    is_error: bool | None = None  # tool_result
    thinking: str | None = None  # thinking (dropped: this server does not think)
    signature: str | None = None
    data: str | None = None  # redacted_thinking
    source: dict[str, Any] | None = None  # image, document (refused)
    cache_control: dict[str, Any] | None = None  # accepted, no effect (prefix caching is automatic)
    citations: Any = None  # accepted, no effect


class MessageParam(Struct, kw_only=True):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(Struct, kw_only=True):
    """A client tool (a function). Anthropic's server tools (`type` web_search_..., bash_...)
    are refused."""

    name: str
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None  # "custom" or absent; anything else is a server tool
    cache_control: dict[str, Any] | None = None


class ToolChoice(Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool"
    disable_parallel_tool_use: bool | None = None


class Metadata(Struct, kw_only=True):
    # Recorded on the usage row (usage_records.end_user), as OpenAI's `user`.
    user_id: Annotated[str, msgspec.Meta(max_length=256)] | None = None


class ThinkingConfig(Struct, kw_only=True):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class _MessageFields(Struct, kw_only=True, forbid_unknown_fields=True):
    """What /v1/messages and /v1/messages/count_tokens share."""

    model: str
    messages: list[MessageParam]
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None  # only {"type": "disabled"}
    cache_control: dict[str, Any] | None = None  # accepted, no effect: prefix caching is automatic


class MessagesRequest(_MessageFields, kw_only=True, forbid_unknown_fields=True):
    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    metadata: Metadata | None = None
    stream: bool = False
    service_tier: str | None = None  # accepted, no effect: one tier here


class CountTokensRequest(_MessageFields, kw_only=True, forbid_unknown_fields=True):
    pass


# --- responses -----------------------------------------------------------------------------


class TextBlock(Struct, kw_only=True, tag_field="type", tag="text"):
    text: str


class ToolUseBlock(Struct, kw_only=True, tag_field="type", tag="tool_use"):
    id: str  # toolu_...
    name: str
    input: dict[str, Any]


class MessageUsage(Struct, kw_only=True):
    input_tokens: int
    output_tokens: int


StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class Message(Struct, kw_only=True):
    id: str  # msg_...
    model: str
    content: list[TextBlock | ToolUseBlock]
    stop_reason: StopReason | None
    stop_sequence: str | None
    usage: MessageUsage
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"


class CountTokensResponse(Struct):
    input_tokens: int
