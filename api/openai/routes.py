"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models,
/tokenize and /detokenize.

Each generation handler: validate the body into token ids and SamplingParams (400s name the
parameter to change), check the caller's key may use the model (403), reserve the request's
worst case (prompt + max_tokens * n) against the key's quotas (429, or 503 when the database
is down), admit a Generation (503 when the queue is full, 499 if the client leaves while it
waits), then answer as one JSON body or as SSE chunks (api/openai/formatting.py) that carry the
key's x-ratelimit-* headers. However the request ends (done, error, client gone), closing the
Generation settles its Ticket (api/usage/accounting.py): one usage row, and the reservation
reconciled to the tokens actually used before the response's last byte.
"""

from __future__ import annotations

import asyncio
import functools
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from litestar import Controller, Request, Response, get, post
from litestar.background_tasks import BackgroundTask
from litestar.di import NamedDependency, Provide
from litestar.params import JSONBody
from litestar.response import Stream

from api.keys.auth import Principal
from api.openai.context_bound import refuse_chat_that_cannot_fit
from api.openai.formatting import ChatFormatter, CompletionFormatter, sse_stream
from api.openai.inputs import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    chat_prompt,
    check_best_of,
    check_model,
    check_priority,
    check_stream_options,
    completion_prompts,
    encode_text,
    fit_context,
    sampling_params,
    template_extras,
)
from api.openai.reasoning import reasoning_split
from api.openai.request_fields import check_fields
from api.openai.schemas import (
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
from api.openai.streaming import (
    SSE_CONTENT_TYPE,
    SSE_DONE,
    SSE_HEADERS,
    ClientDisconnected,
    Generation,
    until_disconnect,
)
from api.openai.structured import supported_structured_outputs, with_structured_outputs
from api.openai.tools.plan import active_parser, constrain, plan_tools, template_input
from api.server.body import require_json_body
from api.server.deps import check_model_access, provide_principal, provide_server, require_principal
from api.server.errors import APIError, invalid_request, request_timed_out, unavailable
from api.server.lifespan import ServerState
from api.server.offload import WorkerPool
from api.tenants.tenancy import engine_tenancy
from api.usage.accounting import CLIENT_CLOSED, Accountant, Ticket
from api.usage.refusals import LEDGER_OWNED
from engine.errors import EngineDeadError, QueueFullError
from engine.protocol import EngineClient, EngineRequest
from engine.sampling_params import SamplingParams


class OpenAIController(Controller):
    guards = [
        require_principal,
        require_json_body,
    ]  # auth first, then the body (api/server/body.py)
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
        max_tokens = data.max_completion_tokens
        if max_tokens is None:
            max_tokens = data.max_tokens
        if data.chat_template is not None and not server.settings.trust_request_chat_template:
            raise invalid_request(
                "Per-request chat templates are off: the server accepts them with "
                "--trust-request-chat-template.",
                "chat_template",
            )
        refuse_chat_that_cannot_fit(  # from sizes alone: before the template's work
            data.messages,
            data.tools if tools is not None and tools.active else None,
            max_tokens,
            engine.max_model_len,
            engine.tokenizer.max_token_chars,
        )
        pool = _pool(request)
        prompt = await chat_prompt(
            pool,
            data.messages,
            data.add_generation_prompt,
            template_kwargs=template_extras(data),
            prepare=functools.partial(template_input, plan=tools, parser=parser),
        )
        unset = max_tokens is None
        max_tokens = fit_context(len(prompt), max_tokens, engine.max_model_len, "messages")
        if unset:  # the rest of the context, or less: the model's max_new_tokens
            max_tokens = min(max_tokens, engine.sampling_defaults.get("max_tokens", max_tokens))
        top = data.top_logprobs
        if top is not None and not data.logprobs:
            raise invalid_request("top_logprobs needs logprobs: true.", "top_logprobs")
        check_priority(data.priority)
        if data.stream and data.prompt_logprobs is not None:
            raise invalid_request(
                "prompt_logprobs is not available with stream: true on chat completions; "
                "ask without streaming, or on /v1/completions.",
                "prompt_logprobs",
            )
        logprobs = (top or 0) if data.logprobs else None
        defaults = engine.sampling_defaults
        params = sampling_params(data, max_tokens, logprobs, defaults)  # ~4 ms at the limits
        params = await with_structured_outputs(data, params, engine)
        params = await constrain(params, tools, engine)

        rid = f"chatcmpl-{uuid.uuid4().hex}"
        reasoning = reasoning_split(
            server.settings.reasoning_parser, engine.tokenizer, prompt, data
        )
        fmt = ChatFormatter(
            rid, engine.model_name, engine.tokenizer, params, data.logprobs, tools, reasoning
        )
        reserved = len(prompt) + max_tokens * params.n
        ticket = await _ticket(request, principal, rid, data, reserved, arrived)
        gen = await _admit(
            server, engine, request, principal, ticket, [rid], [prompt], params, data.priority,
            data.cache_salt,
        )  # fmt: skip
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
        best_of = check_best_of(data)
        max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS if data.max_tokens is None else data.max_tokens
        # echo with max_tokens 0 (lm-eval's loglikelihood requests): the prompt alone; the
        # engine generates one token, which the reply leaves out (vLLM's way)
        echo_only = data.echo and max_tokens == 0
        if echo_only:
            max_tokens = 1
        prompts, texts = await completion_prompts(
            data.prompt,
            engine.tokenizer,
            server.settings.max_prompts_per_request,
            _pool(request),
            max_tokens,
            engine.max_model_len,
        )
        for p in prompts:
            fit_context(len(p), max_tokens, engine.max_model_len, "prompt")
        check_priority(data.priority)
        n = 1 if data.n is None else data.n
        # best_of ranks the samples by cumulative logprob: the engine computes the logprobs
        logprobs = 0 if data.logprobs is None and best_of > n else data.logprobs
        prompt_logprobs = data.prompt_logprobs
        if data.echo and data.logprobs is not None:  # the prompt's tokens get logprobs too
            prompt_logprobs = max(data.logprobs, prompt_logprobs or 0)
        params = sampling_params(
            data,
            max_tokens,
            logprobs,
            engine.sampling_defaults,
            n=best_of,
            prompt_logprobs=prompt_logprobs,
        )
        params = await with_structured_outputs(data, params, engine)

        cid = f"cmpl-{uuid.uuid4().hex}"
        rids = [cid] if len(prompts) == 1 else [f"{cid}-{i}" for i in range(len(prompts))]
        echo = None
        if data.echo:
            echo = [
                t if t is not None else engine.tokenizer.decode(p, skip_special_tokens=False)
                for p, t in zip(prompts, texts, strict=True)
            ]
        fmt = CompletionFormatter(
            cid,
            engine.model_name,
            engine.tokenizer,
            params,
            echo,
            n=n,
            logprobs=data.logprobs,
            echo_only=echo_only,
            prompt_logprobs=data.prompt_logprobs is not None,
        )
        reserved = sum(len(p) + max_tokens * params.n for p in prompts)
        ticket = await _ticket(request, principal, cid, data, reserved, arrived)
        gen = await _admit(
            server, engine, request, principal, ticket, rids, prompts, params, data.priority,
            data.cache_salt,
        )  # fmt: skip
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
        if (data.prompt is None) == (data.messages is None):
            raise invalid_request("Give exactly one of prompt and messages.", "prompt")
        pool = _pool(request)
        if data.prompt is not None:
            ids = await pool.tokenizer_call(
                len(data.prompt), encode_text, data.prompt, data.add_special_tokens
            )
        else:
            messages = data.messages or []
            ids = await chat_prompt(pool, messages, data.add_generation_prompt, "messages")
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


async def _ticket(
    request: Request, principal: Principal, rid: str, data: Any, reserved: int, arrived: float
) -> Ticket:
    """accountant.admit; from here on the accountant writes the request's ledger row (before
    it, a refusal's row comes from api/usage/refusals.py). The body's `user` goes on the row."""
    request.state[LEDGER_OWNED] = True
    ticket = await _accountant(request).admit(principal, rid, data.model, reserved, arrived)
    ticket.end_user = data.user
    return ticket


def _pool(request: Request) -> WorkerPool:
    """The bounded worker pool for CPU-heavy request steps (api/server/offload.py), holding the
    engine's tokenizer (the app started it when the engine became ready)."""
    return request.app.state.cpu_pool


async def _admit(
    server: ServerState,
    engine: EngineClient,
    request: Request,
    principal: Principal,
    ticket: Ticket,
    request_ids: list[str],
    prompts: list[list[int]],
    params: SamplingParams,
    requested_priority: int | None = None,
    cache_salt: str | None = None,
) -> Generation:
    """Start the engine requests; map the engine's refusals to HTTP errors. From here on,
    closing the Generation settles the ticket, whatever happens. The deadline counts from
    the request's arrival (queueing and quota checks included)."""
    accountant = _accountant(request)
    tenancy = engine_tenancy(
        principal,
        server.cache_salt_secret,
        requested_priority,
        ticket.arrived,
        server.settings.request_timeout,
        cache_salt,
    )
    metrics = request.app.state.get("metrics")  # api/server/metrics.py's Metrics, when mounted

    def on_close(gen: Generation) -> None:
        if ticket.status_code is None and gen.error is not None:  # refused, or client gone
            ticket.status_code = _status_code(_engine_error(gen.error))
        accountant.settle(ticket, gen.latest, gen.prompts)
        server.untrack(gen)

    try:
        requests = [
            EngineRequest(rid, ids, params, tenancy)
            for rid, ids in zip(request_ids, prompts, strict=True)
        ]
        gen = Generation(
            engine,
            requests,
            on_close=on_close,
            observer=metrics,
            key_name=principal.key_name,
            key_id=principal.key_id,
        )
    except BaseException:
        ticket.status_code = 500
        accountant.settle(ticket, None, prompts)
        raise
    server.track(gen)
    ticket.submitted = time.monotonic()
    try:
        await until_disconnect(gen.start(), request.receive)
        if _timed_out(gen):  # past its deadline before it started: 504, not a 200 stream
            raise request_timed_out()
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


def _timed_out(gen: Generation) -> bool:
    return any(c.finish_reason == "timeout" for o in gen.latest if o is not None for c in o.outputs)


_REJECTIONS = {QueueFullError: "queue_full", EngineDeadError: "engine_dead"}
_ENGINE_PARAM = re.compile(r"(logit_bias|stop_token_ids) ")
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
        # The engine's input checks: messages made for users, naming the field first.
        m = _ENGINE_PARAM.match(str(exc))
        return invalid_request(str(exc), m.group(1) if m else None)
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
