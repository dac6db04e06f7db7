"""The Anthropic Messages API: POST /v1/messages and /v1/messages/count_tokens.

A Messages body is translated into the chat request it asks for (api/anthropic/translate.py),
which then runs the chat pipeline of api/openai/serving.py: the same key checks, model
access, quotas and rate limits, usage row, deadline, metrics and tool calling as
/v1/chat/completions. Only the answer's shape and the errors' differ: Anthropic's message
object or SSE events, and Anthropic's error body (api/anthropic/errors.py) on these routes.

The key comes as `x-api-key` (Anthropic's SDK) or `Authorization: Bearer` (its auth_token);
`anthropic-version` and `anthropic-beta` are accepted and not checked.
"""

from __future__ import annotations

import functools
import time

from litestar import Request, post
from litestar.connection import ASGIConnection
from litestar.di import NamedDependency
from litestar.handlers.base import BaseRouteHandler
from litestar.params import JSONBody

from api.anthropic.errors import EXCEPTION_HANDLERS
from api.anthropic.formatting import MessageFormatter
from api.anthropic.schemas import CountTokensRequest, CountTokensResponse, Message, MessagesRequest
from api.anthropic.translate import chat_request, new_message_id
from api.keys.auth import Principal
from api.openai.inputs import chat_prompt
from api.openai.serving import (
    admit,
    chat_tool_plan,
    cpu_pool,
    open_ticket,
    prepare_chat,
    require_engine,
    resolve_model,
    run_to_end,
    sse_response,
)
from api.openai.tools.plan import template_input
from api.server.body import require_json_body
from api.server.deps import ClientController
from api.server.errors import invalid_api_key
from api.server.guards import authenticate_header
from api.server.lifespan import ServerState


async def require_anthropic_key(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    """The key from `x-api-key`, else from `Authorization: Bearer`; then as every API route
    (api/server/guards.py: database, static and admin keys, the lockout)."""
    key = connection.headers.get("x-api-key")
    header = f"Bearer {key.strip()}" if key else connection.headers.get("authorization")
    if not header and connection.app.state.authenticator.mode != "none":
        raise invalid_api_key(
            "Missing API key. Send it as an `x-api-key` header (or `Authorization: Bearer <key>`)."
        )
    await authenticate_header(connection, header)


class AnthropicController(ClientController):
    guards = [require_anthropic_key, require_json_body]  # its own key header, then the body
    exception_handlers = EXCEPTION_HANDLERS  # Anthropic's error body on these routes
    tags = ["Anthropic"]

    @post("/v1/messages", status_code=200)
    async def messages(
        self,
        data: JSONBody[MessagesRequest],
        request: Request,
        server: NamedDependency[ServerState],
        principal: NamedDependency[Principal],
    ) -> Message:
        """Anthropic's Messages API; with `stream: true` Anthropic's SSE events."""
        arrived = time.monotonic()
        chat = chat_request(data)
        job = await prepare_chat(chat, request, server)
        engine, params = job.engine, job.params
        rid = new_message_id()
        fmt = MessageFormatter(rid, job.model_name, engine.tokenizer, params, job.tools)
        reserved = len(job.prompt) + job.max_tokens * params.n
        ticket = await open_ticket(request, principal, rid, chat, reserved, arrived, job.adapter)
        gen = await admit(
            server, engine, request, principal, ticket, [rid], [job.prompt], params,
            adapter=job.adapter, streamed=bool(data.stream),
        )  # fmt: skip
        if data.stream:
            return sse_response(request, gen, ticket, fmt.events(gen))  # type: ignore[return-value]
        return await run_to_end(gen, request, ticket, fmt)

    @post("/v1/messages/count_tokens", status_code=200)
    async def count_tokens(
        self,
        data: JSONBody[CountTokensRequest],
        request: Request,
        server: NamedDependency[ServerState],
        principal: NamedDependency[Principal],
    ) -> CountTokensResponse:
        """The prompt's token count after the chat template (tools and system included)."""
        chat = chat_request(data)
        engine = require_engine(server, request)
        resolve_model(request, server, chat.model, engine)
        parser, tools = chat_tool_plan(chat, server, engine)
        ids = await chat_prompt(
            cpu_pool(request),
            chat.messages,
            True,
            "messages",
            prepare=functools.partial(template_input, plan=tools, parser=parser),
        )
        return CountTokensResponse(input_tokens=len(ids))
