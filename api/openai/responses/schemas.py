"""OpenAI Responses API wire format: the request body and the response object as msgspec
Structs.

The request body refuses unknown top-level fields (as OpenAI does); input items and tools
are each one Struct whose `type` says which fields count, so that an item or a tool this
server cannot take (an image, web_search, ...) is refused by api/openai/responses/translate.py
with a message naming it. Items a client sends back from an earlier output carry fields
that have no meaning as input (`id`, `status`, `annotations`): those are accepted as is.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Struct

# --- requests ------------------------------------------------------------------------------


class InputContent(Struct, kw_only=True, omit_defaults=True):
    """One part of a message's content: input_text / output_text (text) are taken; images,
    files and audio are refused (text-only models)."""

    type: str
    text: str | None = None


class InputItem(Struct, kw_only=True, omit_defaults=True):
    """One item of `input`: a message (`type` "message" or absent), a function_call, a
    function_call_output, or a reasoning item (dropped: earlier thinking is not re-read)."""

    type: str | None = None
    role: str | None = None  # message: user | assistant | system | developer
    content: str | list[InputContent] | None = None  # message
    call_id: str | None = None  # function_call, function_call_output
    name: str | None = None  # function_call
    arguments: str | None = None  # function_call: JSON text
    output: str | list[InputContent] | None = None  # function_call_output


class Tool(Struct, kw_only=True):
    """A function tool in the Responses' flat shape; any other `type` (web_search,
    file_search, computer_use_preview, code_interpreter, mcp, ...) is refused."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolChoiceObject(Struct, kw_only=True):
    type: str  # "function" (with name); hosted-tool choices are refused
    name: str | None = None


class TextFormat(Struct, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None  # accepted, no effect: no such control in open models


class ReasoningConfig(Struct, kw_only=True):
    # Accepted, no effect: a reasoning model here thinks as long as it does (no budget), and
    # the reasoning item carries the whole thinking text, never a summary.
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class StreamOptions(Struct, kw_only=True):
    include_obfuscation: bool | None = None  # accepted, no effect: no obfuscation here


Metadata = dict[
    Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]
]


class ResponsesRequest(Struct, kw_only=True, forbid_unknown_fields=True):
    model: str
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: Annotated[int, msgspec.Meta(ge=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] | None = None
    text: TextConfig | None = None
    tools: list[Tool] | None = None
    tool_choice: str | ToolChoiceObject | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    metadata: Annotated[Metadata, msgspec.Meta(max_length=16)] | None = None
    # OpenAI's end-user id: recorded on the usage row (usage_records.end_user)
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    store: bool | None = None  # None: true where the server has a database
    previous_response_id: str | None = None
    # Refused unless they ask for nothing (api/openai/responses/translate.py says why).
    background: bool | None = None
    include: list[str] | None = None
    truncation: str | None = None
    top_logprobs: int | None = None
    conversation: Any = None
    prompt: Any = None
    # Accepted, no effect (as on chat completions): one tier, automatic prefix caching,
    # `user` is the id recorded, no built-in tools to bound.
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    max_tool_calls: int | None = None


# --- the response object -------------------------------------------------------------------


class OutputText(Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(Struct, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(Struct, kw_only=True, tag_field="type", tag="message"):
    id: str  # msg_...
    status: ItemStatus
    content: list[OutputText]
    role: Literal["assistant"] = "assistant"


class FunctionCallItem(Struct, kw_only=True, tag_field="type", tag="function_call"):
    id: str  # fc_...
    call_id: str  # call_...: what the function_call_output answering it names
    name: str
    arguments: str  # JSON text
    status: ItemStatus


class ReasoningItem(Struct, kw_only=True, tag_field="type", tag="reasoning"):
    id: str  # rs_...
    content: list[ReasoningText]
    summary: list[Any] = msgspec.field(default_factory=list)
    status: ItemStatus = "completed"


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class InputTokensDetails(Struct):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache
    cache_write_tokens: int = 0  # nothing is billed for writing the prefix cache here


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct, kw_only=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens_details: OutputTokensDetails


class IncompleteDetails(Struct):
    reason: Literal["max_output_tokens"]


class ResponseObject(Struct, kw_only=True):
    id: str  # resp_...
    created_at: int
    model: str
    status: Literal["in_progress", "completed", "incomplete"]
    output: list[OutputItem]
    usage: ResponseUsage | None
    incomplete_details: IncompleteDetails | None = None
    error: None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    tools: list[dict[str, Any]] = msgspec.field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    user: str | None = None
    store: bool = True
    background: bool = False
    truncation: Literal["disabled"] = "disabled"
    completed_at: int | None = None
    object: Literal["response"] = "response"


class DeletedResponse(Struct):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
