"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models,
/tokenize and /detokenize.

Each generation handler: validate the body into token ids and SamplingParams (400s name the
parameter to change), check the caller's key may use the model (403), reserve the request's
worst case (prompt + max_tokens * n) against the key's quotas (429, or 503 when the database
is down), admit a Generation (503 when the queue is full, 499 if the client leaves while it
waits), then answer as one JSON body or as SSE chunks (api/openai_format.py) that carry the
key's x-ratelimit-* headers. However the request ends (done, error, client gone), closing the
Generation settles its Ticket (api/accounting.py): one usage row, and the reservation
reconciled to the tokens actually used before the response's last byte.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from jinja2 import TemplateError
from litestar import Controller, Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.di import NamedDependency, Provide
from litestar.params import JSONBody
from litestar.response import Stream

from api.accounting import CLIENT_CLOSED, Accountant, Ticket
from api.auth import Principal
from api.deps import check_model_access, provide_principal, provide_server, require_principal
from api.errors import APIError, invalid_request, unavailable
from api.lifespan import ServerState
from api.openai_format import ChatFormatter, CompletionFormatter, sse_stream
from api.openai_inputs import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    chat_messages,
    check_model,
    check_stream_options,
    completion_prompts,
    fit_context,
    off_loop_if_long,
    sampling_params,
    template_extras,
)
from api.request_fields import check_fields
from api.schemas.openai import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from api.streaming import (
    SSE_CONTENT_TYPE,
    SSE_DONE,
    SSE_HEADERS,
    ClientDisconnected,
    Generation,
    until_disconnect,
)
from api.structured_inputs import supported_structured_outputs, with_structured_outputs
from api.tool_calls import active_parser, constrain, plan_tools, template_input
from engine.errors import EngineDeadError, QueueFullError
from engine.sampling_params import SamplingParams


class OpenAIController(Controller):
    guards = [require_principal]
    dependencies = {
        "principal": Provide(provide_principal, sync_to_thread=False),
        "server": Provide(provide_server, sync_to_thread=False),
    }
    tags = ["OpenAI"]

    @post("/v1/chat/completions", status_code=200)
    async def chat_completions(
        self,
        data: JSONBody[ChatCompletionRequest],
        request: Request,
        server: NamedDependency[ServerState],
        principal: NamedDependency[Principal],
    ) -> ChatCompletionResponse:
        """Chat completion; with `stream: true` an SSE stream of chat.completion.chunk events."""
        arrived = time.monotonic()
        check_fields(await request.body(), "chat", lenient=server.settings.lenient_request_fields)
        engine = _require_engine(server, request)
        check_model_access(request, data.model)
        check_model(data.model, engine)
        check_stream_options(data)
        parser = active_parser(server.settings.tool_call_parser, engine.tokenizer)
        tools = plan_tools(data, parser)
        messages, template_kwargs = template_input(chat_messages(data.messages), tools, parser)
        try:
            prompt = await off_loop_if_long(
                sum(len(m["content"]) for m in messages),
                engine.tokenizer.apply_chat_template,
                messages,
                add_generation_prompt=data.add_generation_prompt,
                **template_extras(data),
                **template_kwargs,
            )
        except ValueError as e:  # no chat template
            raise invalid_request(f"{e} Use /v1/completions with a plain prompt.") from None
        except TemplateError as e:  # the template refused the conversation (raise_exception)
            raise invalid_request(
                f"The chat template refused the messages: {e}", "messages"
            ) from None
        max_tokens = data.max_completion_tokens
        if max_tokens is None:
            max_tokens = data.max_tokens
        max_tokens = fit_context(len(prompt), max_tokens, engine.max_model_len, "messages")
        top = data.top_logprobs
        if top is not None and not data.logprobs:
            raise invalid_request("top_logprobs needs logprobs: true.", "top_logprobs")
        params = sampling_params(data, max_tokens, (top or 0) if data.logprobs else None)
        params = await with_structured_outputs(data, params, engine)
        params = await constrain(params, tools, engine)

        rid = f"chatcmpl-{uuid.uuid4().hex}"
        fmt = ChatFormatter(rid, engine.model_name, engine.tokenizer, params, data.logprobs, tools)
        reserved = len(prompt) + max_tokens * params.n
        ticket = await _accountant(request).admit(principal, rid, data.model, reserved, arrived)
        gen = await _admit(server, engine, request, principal, ticket, [rid], [prompt], params)
        if data.stream:
            include_usage = bool(data.stream_options and data.stream_options.include_usage)
            return _sse_response(request, gen, ticket, fmt, include_usage)  # type: ignore[return-value]
        return await _run_to_end(gen, request, ticket, fmt)

    @post("/v1/completions", status_code=200)
    async def completions(
        self,
        data: JSONBody[CompletionRequest],
        request: Request,
        server: NamedDependency[ServerState],
        principal: NamedDependency[Principal],
    ) -> CompletionResponse:
        """Text completion; with `stream: true` an SSE stream of text_completion events."""
        arrived = time.monotonic()
        lenient = server.settings.lenient_request_fields
        check_fields(await request.body(), "completion", lenient=lenient)
        engine = _require_engine(server, request)
        check_model_access(request, data.model)
        check_model(data.model, engine)
        check_stream_options(data)
        if data.suffix:
            raise invalid_request("suffix is not supported.", "suffix")
        if data.best_of is not None and data.best_of != (data.n or 1):
            raise invalid_request("best_of is not supported; use n.", "best_of")
        if data.echo and data.logprobs is not None:
            raise invalid_request(
                "echo together with logprobs is not supported (prompt logprobs are not "
                "computed); drop one of them.",
                "echo",
            )
        prompts, texts = await completion_prompts(
            data.prompt, engine.tokenizer, server.settings.max_prompts_per_request
        )
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if data.max_tokens is None else data.max_tokens
        for p in prompts:
            fit_context(len(p), max_tokens, engine.max_model_len, "prompt")
        params = sampling_params(data, max_tokens, data.logprobs)
        params = await with_structured_outputs(data, params, engine)

        cid = f"cmpl-{uuid.uuid4().hex}"
        rids = [cid] if len(prompts) == 1 else [f"{cid}-{i}" for i in range(len(prompts))]
        echo = None
        if data.echo:
            echo = [
                t if t is not None else engine.tokenizer.decode(p, skip_special_tokens=False)
                for p, t in zip(prompts, texts, strict=True)
            ]
        fmt = CompletionFormatter(cid, engine.model_name, engine.tokenizer, params, echo)
        reserved = sum(len(p) + max_tokens * params.n for p in prompts)
        ticket = await _accountant(request).admit(principal, cid, data.model, reserved, arrived)
        gen = await _admit(server, engine, request, principal, ticket, rids, prompts, params)
        if data.stream:
            include_usage = bool(data.stream_options and data.stream_options.include_usage)
            return _sse_response(request, gen, ticket, fmt, include_usage)  # type: ignore[return-value]
        return await _run_to_end(gen, request, ticket, fmt)

    @get("/v1/models")
    async def models(
        self, server: NamedDependency[ServerState], principal: NamedDependency[Principal]
    ) -> ModelList:
        """The served model, unless the caller's key may not use it."""
        engine = server.require_engine()
        allowed = principal.allowed_models
        if allowed is not None and engine.model_name not in allowed:
            return ModelList(data=[])
        card = ModelCard(
            id=engine.model_name,
            created=int(server.started_at),
            root=server.settings.model,
            max_model_len=engine.max_model_len,
            tool_call_parser=active_parser(server.settings.tool_call_parser, engine.tokenizer)
            or "none",
            structured_outputs=supported_structured_outputs(),
        )
        return ModelList(data=[card])

    @post("/tokenize", status_code=200)
    async def tokenize(
        self,
        data: JSONBody[TokenizeRequest],
        request: Request,
        server: NamedDependency[ServerState],
        principal: NamedDependency[Principal],
    ) -> TokenizeResponse:
        """Token ids of a prompt, or of chat messages rendered with the chat template."""
        engine = server.require_engine()
        if data.model is not None:
            check_model_access(request, data.model)
            check_model(data.model, engine)
        tok = engine.tokenizer
        if (data.prompt is None) == (data.messages is None):
            raise invalid_request("Give exactly one of prompt and messages.", "prompt")
        if data.prompt is not None:
            ids = await off_loop_if_long(
                len(data.prompt),
                tok.encode,
                data.prompt,
                add_special_tokens=data.add_special_tokens,
            )
        else:
            messages = chat_messages(data.messages or [])
            try:
                ids = tok.apply_chat_template(
                    messages, add_generation_prompt=data.add_generation_prompt
                )
            except ValueError as e:
                raise invalid_request(str(e), "messages") from None
        return TokenizeResponse(count=len(ids), max_model_len=engine.max_model_len, tokens=ids)

    @post("/detokenize", status_code=200)
    async def detokenize(
        self,
        data: JSONBody[DetokenizeRequest],
        request: Request,
        server: NamedDependency[ServerState],
        principal: NamedDependency[Principal],
    ) -> DetokenizeResponse:
        engine = server.require_engine()
        if data.model is not None:
            check_model_access(request, data.model)
            check_model(data.model, engine)
        vocab = engine.tokenizer.vocab_size
        bad = next((t for t in data.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid_request(
                f"Token id {bad} is out of range: the vocabulary has {vocab} tokens "
                f"(ids 0..{vocab - 1}).",
                "tokens",
            )
        return DetokenizeResponse(prompt=engine.tokenizer.decode(data.tokens))


# --- admission and answering ---------------------------------------------------------------


def _accountant(request: Request) -> Accountant:
    return request.app.state.accountant


async def _admit(
    server: ServerState,
    engine: Any,
    request: Request,
    principal: Principal,
    ticket: Ticket,
    request_ids: list[str],
    prompts: list[list[int]],
    params: SamplingParams,
) -> Generation:
    """Start the engine requests; map the engine's refusals to HTTP errors. From here on,
    closing the Generation settles the ticket, whatever happens."""
    accountant = _accountant(request)
    metrics = request.app.state.get("metrics")  # api/metrics.py's Metrics, when mounted

    def on_close(gen: Generation) -> None:
        accountant.settle(ticket, gen.latest, gen.prompts)
        server.untrack(gen)

    try:
        gen = Generation(
            engine,
            request_ids,
            prompts,
            params,
            priority=principal.priority,
            on_close=on_close,
            observer=metrics,
            key_name=principal.key_name,
        )
    except BaseException:
        ticket.status_code = 500
        accountant.settle(ticket, None, prompts)
        raise
    server.track(gen)
    ticket.submitted = time.monotonic()
    try:
        await until_disconnect(gen.start(), request.receive)
    except BaseException as exc:
        err = _engine_error(exc)
        ticket.status_code = _status_code(err)
        await gen.close()
        await accountant.released(ticket)
        if metrics is not None and isinstance(exc, QueueFullError | EngineDeadError):
            metrics.rejected("admission", _REJECTIONS[type(exc)])
        raise err from None
    ticket.first_output = time.monotonic()
    return gen


_REJECTIONS = {QueueFullError: "queue_full", EngineDeadError: "engine_dead"}
_PHASE_REJECTIONS = {"loading": "loading", "failed": "engine_dead"}


def _require_engine(server: ServerState, request: Request) -> Any:
    """server.require_engine(), counting a refusal (loading, draining) in the metrics."""
    try:
        return server.require_engine()
    except APIError:
        metrics = request.app.state.get("metrics")
        if metrics is not None:
            reason = _PHASE_REJECTIONS.get(server.phase.value, "draining")
            metrics.rejected("admission", "engine_dead" if server.engine_error else reason)
        raise


def _engine_error(exc: BaseException) -> BaseException:
    if isinstance(exc, QueueFullError):
        return unavailable(str(exc) or "The server is overloaded; retry shortly.", retry_after=1)
    if isinstance(exc, EngineDeadError):
        return unavailable(f"The engine is not running: {exc}", retry_after=5)
    if isinstance(exc, ValueError) and not isinstance(exc, APIError):
        return invalid_request(str(exc))  # the engine's input checks: messages made for users
    return exc


def _status_code(exc: BaseException) -> int:
    if isinstance(exc, APIError):
        return exc.status_code
    if isinstance(exc, ClientDisconnected | asyncio.CancelledError):
        return CLIENT_CLOSED
    return 500


async def _run_to_end(gen: Generation, request: Request, ticket: Ticket, fmt: Any) -> Any:
    try:
        outputs = await until_disconnect(gen.collect(), request.receive)
    except BaseException as exc:
        err = _engine_error(exc)
        ticket.status_code = _status_code(err)
        if isinstance(err, ClientDisconnected):
            return Response(content=b"", status_code=CLIENT_CLOSED)  # nobody is listening
        raise err from None
    finally:
        await gen.close()  # settles the ticket
        await _accountant(request).released(ticket)
    # Raises the envelope (503 / 500) for a request the engine aborted or failed.
    body = fmt.response(outputs, gen.prompts)
    return Response(content=body, headers=ticket.headers)


def _sse_response(
    request: Request, gen: Generation, ticket: Ticket, fmt: Any, include_usage: bool
) -> Stream:
    # The background task is a fallback for a body that never ran (it may not run at all if
    # sending failed): the body's own `finally` closes the Generation in every other case.
    # The content type is a header: Litestar would let the handler's JSON media type win.
    return Stream(
        _sse_body(gen, ticket, _accountant(request), fmt, include_usage),
        headers={"content-type": SSE_CONTENT_TYPE, **SSE_HEADERS, **ticket.headers},
        background=BackgroundTask(gen.close),
    )


async def _sse_body(
    gen: Generation, ticket: Ticket, accountant: Accountant, fmt: Any, include_usage: bool
) -> AsyncIterator[bytes]:
    """sse_stream, with the request settled before its final `[DONE]`; a client that leaves
    (Litestar cancels the body) is settled as 499 without anything awaited."""
    completed = False
    try:
        async for chunk in sse_stream(gen, fmt, include_usage):
            if chunk is SSE_DONE:
                completed = True
                await gen.close()  # the status comes from the outputs (200, or 503 / 500)
                await accountant.released(ticket)
            yield chunk
    finally:
        if not completed:
            ticket.status_code = ticket.status_code or CLIENT_CLOSED
            gen.close_soon()
