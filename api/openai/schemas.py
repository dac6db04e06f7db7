"""OpenAI wire format: request and response bodies as msgspec Structs.

Field names, defaults and nesting follow OpenAI's API (and vLLM's extras: top_k, min_p,
repetition_penalty, min_tokens, ignore_eos, stop_token_ids, skip_special_tokens, ...).
Which top-level request fields are accepted, ignored or refused is api/openai/request_fields.py's
call (it sees the raw body first); these Structs decode the ones Tessera acts on. Optional
response fields that OpenAI omits are UNSET (msgspec leaves them out); ones it sends as null
are None.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Struct, UnsetType

# --- requests ------------------------------------------------------------------------------


class ContentPart(Struct):
    type: str
    text: str | None = None


class FunctionCallIn(Struct):
    name: str
    # OpenAI sends a JSON string; some clients send the object itself.
    arguments: str | dict[str, Any] = "{}"


class ToolCallIn(Struct, kw_only=True):
    """A tool call of an earlier assistant turn, as the client sends it back."""

    function: FunctionCallIn
    id: str | None = None
    type: str = "function"


class ChatMessage(Struct, kw_only=True):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: str | None = None  # tool turns


class FunctionDefinition(Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: no arguments
    strict: bool | None = None


class ToolDefinition(Struct, kw_only=True):
    function: FunctionDefinition
    type: str = "function"


class NamedFunction(Struct):
    name: str


class NamedToolChoice(Struct, kw_only=True):
    function: NamedFunction
    type: str = "function"


class StreamOptions(Struct):
    include_usage: bool = False


# Structured output (api/openai/structured.py turns these into StructuredOutputsParams).
class JsonSchemaFormat(Struct, kw_only=True):
    name: str | None = None
    description: str | None = None
    schema: dict | None = None
    strict: bool | None = None  # accepted; the grammar enforces the schema either way


class ResponseFormat(Struct, kw_only=True):
    type: str
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(Struct, kw_only=True):
    """vLLM's `structured_outputs` extra: exactly one of the forms."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class _SamplingFields(Struct, kw_only=True):
    """Parameters shared by chat and completions (OpenAI's and vLLM's extras)."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI's end-user id: recorded on the usage row (usage_records.end_user)
    user: Annotated[str, msgspec.Meta(max_length=256)] | None = None
    # vLLM extras
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # structured output: OpenAI's response_format, vLLM's structured_outputs and guided_*
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # vLLM's scheduling priority (lower runs first), never better than the key's own.
    priority: int | None = None
    # vLLM's: requests share prefix-cache blocks only with the same salt (within the key's
    # or tenant's own scope, api/tenants/tenancy.py)
    cache_salt: Annotated[str, msgspec.Meta(min_length=1, max_length=256)] | None = None
    # vLLM's: each prompt token's logprob and that many top alternatives (PromptLogprob)
    prompt_logprobs: int | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # tool calling (api/openai/tools/plan.py)
    tools: list[ToolDefinition] | None = None
    tool_choice: str | NamedToolChoice | None = None  # none | auto | required | a function
    parallel_tool_calls: bool | None = None
    # a chat-template variable (gpt-oss's template sets its reasoning level from it)
    reasoning_effort: str | None = None
    # vLLM's chat-template extras
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    # vLLM's: with --reasoning-parser, false leaves the thinking out of the reply
    include_reasoning: bool = True
    # vLLM's: a template for this request (only with --trust-request-chat-template)
    chat_template: str | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # str, list of str, list of token ids, or list of token-id lists.
    # (msgspec allows one array type per union, so the inner union carries the variants.)
    prompt: str | list[str | int | list[int]]
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


class EmbeddingRequest(Struct, kw_only=True):
    """POST /v1/embeddings (OpenAI's, and vLLM's truncate_prompt_tokens)."""

    model: str
    # str, list of str, list of token ids, or list of token-id lists (as CompletionRequest)
    input: str | list[str | int | list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # keep the last k tokens of each input (-1: max_model_len); unset: longer inputs are a 400
    truncate_prompt_tokens: int | None = None


class TokenizeRequest(Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(Struct, kw_only=True):
    tokens: list[int]
    model: str | None = None


# --- responses -----------------------------------------------------------------------------


class PromptTokensDetails(Struct):
    cached_tokens: int = 0


class Usage(Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(Struct):
    content: list[ChatTokenLogprob] | None


class FunctionCall(Struct):
    name: str
    arguments: str  # JSON text


class ToolCall(Struct, kw_only=True):
    id: str
    function: FunctionCall
    type: str = "function"


class ChatResponseMessage(Struct):
    content: str | None
    role: str = "assistant"
    tool_calls: list[ToolCall] | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET  # --reasoning-parser: the think section


class PromptLogprob(Struct):
    """vLLM's Logprob: one token's entry in a prompt position's dict (keyed by token id)."""

    logprob: float
    rank: int | None
    decoded_token: str | None


# vLLM's prompt_logprobs: per prompt position (the first is null) the prompt token's entry
# and the top alternatives', keyed by token id.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class ChatChoice(Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None


class ChatCompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # vLLM's, when asked


class DeltaFunctionCall(Struct):
    name: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET


class DeltaToolCall(Struct, kw_only=True):
    """OpenAI's streamed call: the first delta of a call carries id, type and name (and
    arguments ""), later ones only index and an arguments fragment."""

    index: int
    function: DeltaFunctionCall
    id: str | UnsetType = UNSET
    type: str | UnsetType = UNSET


class DeltaMessage(Struct):
    role: str | UnsetType = UNSET
    content: str | UnsetType = UNSET
    reasoning_content: str | UnsetType = UNSET
    tool_calls: list[DeltaToolCall] | UnsetType = UNSET


class ChatChunkChoice(Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    system_fingerprint: str | None = None
    # Absent unless stream_options.include_usage; then null on every chunk but the last.
    usage: Usage | None | UnsetType = UNSET


class CompletionLogprobs(Struct):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(Struct):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: str | None
    prompt_logprobs: PromptLogprobs | UnsetType = UNSET  # vLLM's, when asked


class CompletionResponse(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: str | None = None


class CompletionChunk(Struct):
    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    object: Literal["text_completion"] = "text_completion"
    system_fingerprint: str | None = None
    usage: Usage | None | UnsetType = UNSET


class ModelCard(Struct):
    id: str
    created: int
    root: str
    max_model_len: int
    object: Literal["model"] = "model"
    owned_by: str = "tessera"
    parent: str | None = None
    tool_call_parser: str | UnsetType = UNSET  # how tool calls are read from the output
    # the structured-output forms requests may use (api/openai/structured.py)
    structured_outputs: list[str] = msgspec.field(default_factory=list)


class ModelList(Struct):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class TokenizeResponse(Struct):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(Struct):
    prompt: str


class ErrorDetail(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    """The envelope of every error (api/server/errors.py builds it)."""

    error: ErrorDetail


class EmbeddingData(Struct):
    index: int
    # floats, or base64 of little-endian float32 (encoding_format "base64")
    embedding: list[float] | str
    object: Literal["embedding"] = "embedding"


class EmbeddingUsage(Struct):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(Struct):
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage
    object: Literal["list"] = "list"
