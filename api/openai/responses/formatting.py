"""The chat formatter's answer in the Responses shape: the response object (its typed SSE
events are api/openai/responses/events.py's).

The chat message's reasoning_content (--reasoning-parser) -> a reasoning item with the
thinking text; its content -> a message item with one output_text part; each tool call -> a
function_call item (call_id the chat call's id). finish_reason "length" -> status
"incomplete" with incomplete_details.reason "max_output_tokens". The request's settings
are echoed back on the object, as OpenAI does.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import msgspec
from msgspec import UNSET

from api.openai.formatting import ChatFormatter
from api.openai.reasoning import ReasoningSplit
from api.openai.responses.events import EventStream
from api.openai.responses.schemas import (
    FunctionCallItem,
    IncompleteDetails,
    InputTokensDetails,
    OutputItem,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
)
from api.openai.responses.translate import new_id
from api.openai.schemas import Usage
from api.openai.streaming import Generation
from api.openai.tools.plan import ToolPlan
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


class ResponseFormatter:
    """The chat formatter's answer (reasoning, text, tool calls, finish, usage) as a
    response object, whole (`response`) or as SSE events (`events`)."""

    def __init__(
        self,
        rid: str,
        model: str,
        tokenizer: Any,
        params: SamplingParams,
        body: ResponsesRequest,
        *,
        tools: ToolPlan | None,
        reasoning: ReasoningSplit | None,
        store: bool,
    ) -> None:
        self.id = rid
        self.model = model
        self.tokenizer = tokenizer
        self.body = body
        self.store = store
        self.created = int(time.time())
        self.chat = ChatFormatter(rid, model, tokenizer, params, False, tools, reasoning)

    def shell(
        self,
        status: str,
        output: list[OutputItem],
        usage: ResponseUsage | None,
        finish: str | None = None,
    ) -> ResponseObject:
        """The response object with the request's settings echoed back."""
        b = self.body
        incomplete = finish == "length"
        text = msgspec.to_builtins(b.text) if b.text is not None else {}
        if text.get("format") is None:
            text["format"] = {"type": "text"}
        choice = b.tool_choice
        return ResponseObject(
            id=self.id,
            created_at=self.created,
            model=self.model,
            status="incomplete" if incomplete else status,  # type: ignore[arg-type]
            output=output,
            usage=usage,
            incomplete_details=IncompleteDetails("max_output_tokens") if incomplete else None,
            instructions=b.instructions,
            max_output_tokens=b.max_output_tokens,
            previous_response_id=b.previous_response_id,
            temperature=b.temperature,
            top_p=b.top_p,
            text=text,
            tools=[msgspec.to_builtins(t) for t in b.tools or ()],
            tool_choice=msgspec.to_builtins(choice) if choice is not None else "auto",
            parallel_tool_calls=b.parallel_tool_calls is not False,
            metadata=dict(b.metadata or {}),
            user=b.user,
            store=self.store,
            completed_at=int(time.time()) if status == "completed" and not incomplete else None,
        )

    def usage(self, usage: Usage, reasoning: str) -> ResponseUsage:
        thought = (
            len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        )
        return ResponseUsage(
            input_tokens=usage.prompt_tokens,
            output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
            input_tokens_details=InputTokensDetails(usage.prompt_tokens_details.cached_tokens),
            output_tokens_details=OutputTokensDetails(min(thought, usage.completion_tokens)),
        )

    def response(
        self, outputs: list[RequestOutput | None], prompts: list[list[int]]
    ) -> ResponseObject:
        chat = self.chat.response(outputs, prompts)  # raises for an aborted or failed request
        choice = chat.choices[0]
        message = choice.message
        status = "incomplete" if choice.finish_reason == "length" else "completed"
        items: list[OutputItem] = []
        thinking = message.reasoning_content if message.reasoning_content is not UNSET else ""
        if thinking:
            items.append(ReasoningItem(id=new_id("rs"), content=[ReasoningText(text=thinking)]))
        calls = message.tool_calls if message.tool_calls is not UNSET else []
        if message.content or not (calls or items):
            text = [OutputText(text=message.content or "")]
            items.append(OutputMessage(id=new_id("msg"), status=status, content=text))  # type: ignore[arg-type]
        for call in calls:
            items.append(
                FunctionCallItem(
                    id=new_id("fc"),
                    call_id=call.id,
                    name=call.function.name,
                    arguments=call.function.arguments,
                    status="completed",
                )
            )
        usage = self.usage(chat.usage, thinking)
        return self.shell("completed", items, usage, choice.finish_reason)

    def events(
        self, gen: Generation, on_done: Callable[[ResponseObject], Awaitable[None]]
    ) -> AsyncIterator[Any]:
        """The SSE events; `on_done(final)` runs after the request is settled and before
        response.completed (the store's write: if it fails, the stream ends with an error)."""
        return EventStream(self, gen, on_done).run()
