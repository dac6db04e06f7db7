"""One generation request from a validated body to its answer, for every surface that
generates (the OpenAI routes here, api/anthropic/): the chat body's preparation (prompt,
SamplingParams, tools), the usage ticket, admission into the engine, and the answer as one
body or as an SSE stream.

    job = await prepare_chat(data, request, server)      # 400s, 404, 503 (no engine)
    ticket = await open_ticket(request, principal, rid, data, reserved, arrived, job.adapter)
    gen = await admit(server, engine, request, principal, ticket, [rid], [prompt], params,
                      adapter=job.adapter)
    return await run_to_end(gen, request, ticket, fmt)   # fmt.response(outputs, prompts)
    return sse_response(request, gen, ticket, chunks)    # chunks yield SETTLE before the last

`model` is the served model or one of the LoRA adapters the caller may call (resolve_model,
api/lora/registry.py): the adapter rides on the engine requests, its name on the usage row,
and it counts as in use (not unloadable) until the Generation closes.

Admission maps the engine's refusals to HTTP errors (503 queue full or engine down, 504 past
the deadline, 499 client gone); from there on closing the Generation settles the ticket
(api/usage/accounting.py): one usage row, and the reservation reconciled to the tokens
actually used before the response's last byte.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from litestar import Request, Response
from litestar.background_tasks import BackgroundTask
from litestar.response import Stream

from api.keys.auth import Principal
from api.lora.registry import Adapter, AdapterNotFound
from api.openai.context_bound import refuse_chat_that_cannot_fit
from api.openai.inputs import (
    chat_prompt,
    check_model,
    check_priority,
    check_stream_options,
    fit_context,
    sampling_params,
    template_extras,
)
from api.openai.schemas import ChatCompletionRequest
from api.openai.streaming import (
    SETTLE,
    SSE_CONTENT_TYPE,
    SSE_HEADERS,
    ClientDisconnected,
    Generation,
    until_disconnect,
)
from api.openai.structured import with_structured_outputs
from api.openai.tools.plan import ToolPlan, active_parser, constrain, plan_tools, template_input
from api.server.deps import check_model_access
from api.server.errors import (
    APIError,
    invalid_request,
    model_not_found,
    request_timed_out,
    unavailable,
)
from api.server.guards import principal_of
from api.server.lifespan import ServerState
from api.server.offload import WorkerPool
from api.tenants.tenancy import engine_tenancy
from api.usage.accounting import CLIENT_CLOSED, Accountant, Ticket
from api.usage.refusals import LEDGER_OWNED
from engine.errors import EngineDeadError, QueueFullError
from engine.pooling_params import PoolingParams
from engine.protocol import EngineClient, EngineRequest
from engine.reasoning import REASONING_FORMATS
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class ChatJob:
    """A chat body made ready for the engine."""

    engine: Any
    prompt: list[int]
    params: SamplingParams
    tools: ToolPlan | None
    max_tokens: int
    adapter: Adapter | None = None  # the LoRA adapter `model` named; None: the base model

    @property
    def model_name(self) -> str:
        """What the answer's `model` says: the adapter's name, or the served model's."""
        return self.adapter.name if self.adapter is not None else self.engine.model_name


def resolve_model(request: Request, server: ServerState, model: str, engine: Any) -> Adapter | None:
    """The LoRA adapter `model` names (None: the served model): 403 when the key's
    allowed_models leave it out, 404 model_not_found for an unknown name and for an adapter
    another tenant owns (the same answer: its name is not disclosed)."""
    check_model_access(request, model)
    adapters = server.adapters
    if adapters is not None:
        try:
            adapter = adapters.resolve(model, principal_of(request))
        except AdapterNotFound:
            raise model_not_found(model) from None
        if adapter is not None:
            return adapter
    check_model(model, engine)
    return None


def chat_tool_plan(data: ChatCompletionRequest, server: ServerState, engine: Any) -> tuple:
    """(the active parser, the request's ToolPlan or None)."""
    parser = active_parser(server.settings.tool_call_parser, engine.tokenizer)
    return parser, plan_tools(data, parser)


async def prepare_chat(
    data: ChatCompletionRequest, request: Request, server: ServerState
) -> ChatJob:
    """The chat body -> prompt token ids, SamplingParams (grammar included) and tool plan;
    400s name the field to change, 403 / 404 the model, 503 without an engine."""
    engine = require_engine(server, request)
    adapter = resolve_model(request, server, data.model, engine)
    require_runner(engine, "generate")
    check_stream_options(data)
    parser, tools = chat_tool_plan(data, server, engine)
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
    prompt = await chat_prompt(
        cpu_pool(request),
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
    reasoning = REASONING_FORMATS.get(server.settings.reasoning_parser or "")
    if reasoning is not None and reasoning.keeps_special_tokens and params.skip_special_tokens:
        # harmony's channel markers are special tokens: the split reads them, and drops them
        params = dataclasses.replace(params, skip_special_tokens=False)
    return ChatJob(engine, prompt, params, tools, max_tokens, adapter)


def accountant_of(request: Request) -> Accountant:
    return request.app.state.accountant


async def open_ticket(
    request: Request,
    principal: Principal,
    rid: str,
    data: Any,
    reserved: int,
    arrived: float,
    adapter: Adapter | None = None,
) -> Ticket:
    """accountant.admit; from here on the accountant writes the request's ledger row (before
    it, a refusal's row comes from api/usage/refusals.py). The body's `user` and the LoRA
    adapter go on the row. Quotas and fair share charge the key's tenant as for the base
    model."""
    request.state[LEDGER_OWNED] = True
    ticket = await accountant_of(request).admit(principal, rid, data.model, reserved, arrived)
    ticket.end_user = data.user
    ticket.lora_adapter = adapter.name if adapter is not None else None
    return ticket


def cpu_pool(request: Request) -> WorkerPool:
    """The bounded worker pool for CPU-heavy request steps (api/server/offload.py), holding the
    engine's tokenizer (the app started it when the engine became ready)."""
    return request.app.state.cpu_pool


async def admit(
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
    adapter: Adapter | None = None,
    pooling: PoolingParams | None = None,
    streamed: bool = True,
) -> Generation:
    """Start the engine requests; map the engine's refusals to HTTP errors. From here on,
    closing the Generation settles the ticket, whatever happens. The deadline counts from
    the request's arrival (queueing and quota checks included); cache_salt: the body's
    (vLLM's), within the key's or tenant's own prefix-cache scope; pooling: embedding
    requests (api/openai/embeddings.py), pooled instead of sampled; streamed False: a whole
    answer, whose outputs the engine sends only first and last (EngineRequest.streamed)."""
    accountant = accountant_of(request)
    tenancy = engine_tenancy(
        principal,
        server.cache_salt_secret,
        requested_priority,
        ticket.arrived,
        server.settings.request_timeout,
        cache_salt,
    )
    metrics = request.app.state.get("metrics")  # api/server/metrics.py's Metrics, when mounted
    adapters = server.adapters if adapter is not None else None
    held = [False]  # the adapter counted as in use (unload answers 409 meanwhile)

    def on_close(gen: Generation) -> None:
        if ticket.status_code is None and gen.error is not None:  # refused, or client gone
            ticket.status_code = _status_code(engine_error(gen.error))
        accountant.settle(ticket, gen.latest, gen.prompts)
        server.untrack(gen)
        if held[0] and adapters is not None and adapter is not None:
            held[0] = False
            adapters.release(adapter.name)

    lora = adapter.request if adapter is not None else None
    if adapters is not None and adapter is not None:
        # Unloaded since the request resolved it (its template, its quota awaited): as if
        # unknown. From here on it counts as in use, no await between the check and that.
        if adapters.adapters.get(adapter.name) is not adapter:
            ticket.status_code = 404
            accountant.settle(ticket, None, prompts)
            raise model_not_found(adapter.name)
        adapters.acquire(adapter.name)
        held[0] = True
    try:
        requests = [
            EngineRequest(
                rid, ids, params, tenancy, adapter=lora, pooling=pooling, streamed=streamed
            )
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
        if held[0] and adapters is not None and adapter is not None:
            held[0] = False
            adapters.release(adapter.name)
        raise
    server.track(gen)
    ticket.submitted = time.monotonic()
    try:
        await until_disconnect(gen.start(), request.receive)
        if _timed_out(gen):  # past its deadline before it started: 504, not a 200 stream
            raise request_timed_out()
    except BaseException as exc:
        err = engine_error(exc)
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


def require_engine(server: ServerState, request: Request) -> Any:
    """server.require_engine(), counting a refusal (loading, draining) in the metrics."""
    try:
        return server.require_engine()
    except APIError:
        metrics = request.app.state.get("metrics")
        if metrics is not None:
            reason = _PHASE_REJECTIONS.get(server.phase.value, "draining")
            metrics.rejected("admission", "engine_dead" if server.engine_error else reason)
        raise


_RUNNER_REFUSALS = {
    "generate": (
        "This server runs --runner pooling: it serves embeddings (/v1/embeddings), not text "
        "generation; serve a generative model with --runner generate for that.",
        "model",
    ),
    "pooling": (
        "This server runs --runner generate: embeddings need a server started with "
        "--runner pooling and an embedding model.",
        "model",
    ),
}


def require_runner(engine: Any, runner: str) -> None:
    """400 naming the runner when the engine runs the other one (a generative route on a
    pooling server, /v1/embeddings on a generating one)."""
    if getattr(engine, "runner", "generate") != runner:
        raise invalid_request(*_RUNNER_REFUSALS[runner])


def engine_error(exc: BaseException) -> BaseException:
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


async def run_to_end(gen: Generation, request: Request, ticket: Ticket, fmt: Any) -> Any:
    """The whole answer: `fmt.response(outputs, prompts)` (a Struct, or raises the error of a
    request the engine aborted or failed) with the key's rate-limit headers."""
    try:
        outputs = await until_disconnect(gen.collect(), request.receive)
    except BaseException as exc:
        err = engine_error(exc)
        ticket.status_code = _status_code(err)
        if isinstance(err, ClientDisconnected):
            return Response(content=b"", status_code=CLIENT_CLOSED)  # nobody is listening
        raise err from None
    finally:
        await gen.close()  # settles the ticket
        await accountant_of(request).released(ticket)
    body = fmt.response(outputs, gen.prompts)
    return Response(content=body, headers=ticket.headers)


def sse_response(
    request: Request, gen: Generation, ticket: Ticket, chunks: AsyncIterator[Any]
) -> Stream:
    """`chunks` (bytes, and SETTLE once just before the last) as an SSE response."""
    # The background task is a fallback for a body that never ran (it may not run at all if
    # sending failed): the body's own `finally` closes the Generation in every other case.
    # The content type is a header: Litestar would let the handler's JSON media type win.
    return Stream(
        _sse_body(gen, ticket, accountant_of(request), chunks),
        headers={"content-type": SSE_CONTENT_TYPE, **SSE_HEADERS, **ticket.headers},
        background=BackgroundTask(gen.close),
    )


async def _sse_body(
    gen: Generation, ticket: Ticket, accountant: Accountant, chunks: AsyncIterator[Any]
) -> AsyncIterator[bytes]:
    """The chunks, with the request settled at SETTLE (before the stream's last chunk); a
    client that leaves (Litestar cancels the body) is settled as 499 without anything
    awaited."""
    completed = False
    try:
        async for chunk in chunks:
            if chunk is SETTLE:
                completed = True
                await gen.close()  # the status comes from the outputs (200, or 503 / 500)
                await accountant.released(ticket)
                continue
            yield chunk
    finally:
        if not completed:
            ticket.status_code = ticket.status_code or CLIENT_CLOSED
            gen.close_soon()
