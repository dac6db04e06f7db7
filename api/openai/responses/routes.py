"""The OpenAI Responses API: POST /v1/responses, GET and DELETE /v1/responses/{response_id}.

A Responses body (with the stored conversation of its previous_response_id in front) is
translated into the chat request it asks for (api/openai/responses/translate.py), which then
runs the chat pipeline of api/openai/serving.py: the same key checks, model access, quotas
and rate limits, usage row, deadline, metrics, grammar and tool calling as
/v1/chat/completions. The answer is the response object or its typed SSE events
(api/openai/responses/formatting.py).

store (default true where the server has a database): a request that succeeded is written
(api/openai/responses/store.py) before its answer's last byte; a failed one writes nothing.
Stored responses belong to the creating key's tenant: other tenants' keys get 404.
"""

from __future__ import annotations

import time

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.di import NamedDependency
from litestar.params import FromPath, JSONBody

from api.keys.auth import Principal
from api.openai.reasoning import reasoning_split
from api.openai.responses.formatting import ResponseFormatter
from api.openai.responses.schemas import DeletedResponse, ResponseObject, ResponsesRequest
from api.openai.responses.store import ResponseStore
from api.openai.responses.translate import (
    chat_request,
    input_items,
    items_as_json,
    items_from_json,
    new_id,
)
from api.openai.serving import admit, open_ticket, prepare_chat, run_to_end, sse_response
from api.server.deps import ClientController
from api.server.errors import APIError, invalid_request
from api.server.lifespan import ServerState


def _store_of(request: Request) -> ResponseStore | None:
    return request.app.state.get("response_store")


def _not_found(response_id: str, param: str | None = None) -> APIError:
    # The same answer for an unknown id and for another tenant's: ids do not leak.
    return APIError(
        404,
        f"No response with id '{response_id}' found.",
        "invalid_request_error",
        param=param,
        code="response_not_found",
    )


def _no_store(param: str) -> APIError:
    return invalid_request(
        f"{param} needs the server's database (keys mode or --database-url); this server "
        "stores no responses. Send store: false.",
        param,
    )


class ResponsesController(ClientController):
    tags = ["OpenAI"]

    @post("/v1/responses", status_code=200)
    async def create(
        self,
        data: JSONBody[ResponsesRequest],
        request: Request,
        server: NamedDependency[ServerState],
        principal: NamedDependency[Principal],
    ) -> ResponseObject:
        """A model response; with `stream: true` the typed SSE events (response.created ...
        response.completed)."""
        arrived = time.monotonic()
        store = _store_of(request)
        keep = data.store if data.store is not None else store is not None
        if keep and store is None:
            raise _no_store("store")
        history = []
        if data.previous_response_id is not None:
            if store is None:
                raise _no_store("previous_response_id")
            previous = await store.get(principal, data.previous_response_id)
            if previous is None:
                raise _not_found(data.previous_response_id, "previous_response_id")
            earlier = previous.input_items + previous.response.get("output", [])
            history = items_from_json(earlier)
        history += input_items(data)
        chat = chat_request(data, history)
        job = await prepare_chat(chat, request, server)
        engine, params = job.engine, job.params
        rid = new_id("resp")
        reasoning = reasoning_split(
            server.settings.reasoning_parser, engine.tokenizer, job.prompt, chat
        )
        fmt = ResponseFormatter(
            rid, job.model_name, engine.tokenizer, params, data,
            tools=job.tools, reasoning=reasoning, store=keep,
        )  # fmt: skip

        async def save(final: ResponseObject) -> None:
            if keep and store is not None:
                body = msgspec.to_builtins(final)
                await store.save(principal, body, items_as_json(history), data.previous_response_id)

        reserved = len(job.prompt) + job.max_tokens * params.n
        ticket = await open_ticket(request, principal, rid, chat, reserved, arrived, job.adapter)
        gen = await admit(
            server, engine, request, principal, ticket, [rid], [job.prompt], params,
            adapter=job.adapter, streamed=bool(data.stream),
        )  # fmt: skip
        if data.stream:
            return sse_response(request, gen, ticket, fmt.events(gen, save))  # type: ignore[return-value]
        answer = await run_to_end(gen, request, ticket, fmt)
        if isinstance(answer, Response) and isinstance(answer.content, ResponseObject):
            await save(answer.content)  # before the answer: a stored id is readable at once
        return answer

    @get("/v1/responses/{response_id:str}")
    async def retrieve(
        self, response_id: FromPath[str], request: Request, principal: NamedDependency[Principal]
    ) -> ResponseObject:
        """A stored response (404 for an unknown id and for another tenant's)."""
        store = _store_of(request)
        found = await store.get(principal, response_id) if store is not None else None
        if found is None:
            raise _not_found(response_id)
        return msgspec.convert(found.response, ResponseObject)

    @delete("/v1/responses/{response_id:str}", status_code=200)
    async def remove(
        self, response_id: FromPath[str], request: Request, principal: NamedDependency[Principal]
    ) -> DeletedResponse:
        """Delete a stored response (404 for an unknown id and for another tenant's)."""
        store = _store_of(request)
        if store is None or not await store.delete(principal, response_id):
            raise _not_found(response_id)
        return DeletedResponse(id=response_id)
