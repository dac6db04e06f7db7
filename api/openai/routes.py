"""The OpenAI-compatible routes: /v1/chat/completions, /v1/completions, /v1/models,
/tokenize and /detokenize.

Each generation handler: validate the body into token ids and SamplingParams (400s name the
parameter to change), check the caller's key may use the model (403), reserve the request's
worst case (prompt + max_tokens * n) against the key's quotas (429, or 503 when the database
is down), admit a Generation (503 when the queue is full, 499 if the client leaves while it
waits), then answer as one JSON body or as SSE chunks (api/openai/formatting.py) that carry the
key's x-ratelimit-* headers. The steps from a validated body to the answer are
api/openai/serving.py's, shared with api/anthropic/. However the request ends (done, error,
client gone), closing the Generation settles its Ticket (api/usage/accounting.py): one usage
row, and the reservation reconciled to the tokens actually used before the response's last
byte.
"""

from __future__ import annotations

import time
import uuid

from litestar import Request, get, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from api.keys.auth import Principal
from api.openai.formatting import ChatFormatter, CompletionFormatter, sse_stream
from api.openai.inputs import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    chat_prompt,
    check_best_of,
    check_priority,
    check_stream_options,
    completion_prompts,
    encode_text,
    fit_context,
    sampling_params,
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
from api.openai.serving import (
    admit,
    cpu_pool,
    open_ticket,
    prepare_chat,
    require_engine,
    require_runner,
    resolve_model,
    run_to_end,
    sse_response,
)
from api.openai.structured import supported_structured_outputs, with_structured_outputs
from api.openai.tools.plan import active_parser
from api.server.deps import ClientController
from api.server.errors import invalid_request
from api.server.lifespan import ServerState


class OpenAIController(ClientController):
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
        job = await prepare_chat(data, request, server)
        engine, params = job.engine, job.params
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        reasoning = reasoning_split(
            server.settings.reasoning_parser, engine.tokenizer, job.prompt, data
        )
        fmt = ChatFormatter(
            rid, job.model_name, engine.tokenizer, params, data.logprobs, job.tools, reasoning
        )
        reserved = len(job.prompt) + job.max_tokens * params.n
        ticket = await open_ticket(request, principal, rid, data, reserved, arrived, job.adapter)
        gen = await admit(
            server, engine, request, principal, ticket, [rid], [job.prompt], params,
            data.priority, data.cache_salt, adapter=job.adapter, streamed=bool(data.stream),
        )  # fmt: skip
        if data.stream:
            include_usage = bool(data.stream_options and data.stream_options.include_usage)
            return sse_response(request, gen, ticket, sse_stream(gen, fmt, include_usage))  # type: ignore[return-value]
        return await run_to_end(gen, request, ticket, fmt)

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
        engine = require_engine(server, request)
        adapter = resolve_model(request, server, data.model, engine)
        require_runner(engine, "generate")
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
            cpu_pool(request),
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
            adapter.name if adapter is not None else engine.model_name,
            engine.tokenizer,
            params,
            echo,
            n=n,
            logprobs=data.logprobs,
            echo_only=echo_only,
            prompt_logprobs=data.prompt_logprobs is not None,
        )
        reserved = sum(len(p) + max_tokens * params.n for p in prompts)
        ticket = await open_ticket(request, principal, cid, data, reserved, arrived, adapter)
        gen = await admit(
            server, engine, request, principal, ticket, rids, prompts, params, data.priority,
            data.cache_salt, adapter=adapter, streamed=bool(data.stream),
        )  # fmt: skip
        if data.stream:
            include_usage = bool(data.stream_options and data.stream_options.include_usage)
            return sse_response(request, gen, ticket, sse_stream(gen, fmt, include_usage))  # type: ignore[return-value]
        return await run_to_end(gen, request, ticket, fmt)

    @get("/v1/models")
    async def models(
        self, server: NamedDependency[ServerState], principal: NamedDependency[Principal]
    ) -> ModelList:
        """The served model and the LoRA adapters the caller may call (vLLM's shape: `root`
        the adapter's folder, `parent` the base model), less what the key's allowed_models
        leave out."""
        engine = server.require_engine()
        allowed = principal.allowed_models
        cards = []
        if allowed is None or engine.model_name in allowed:
            cards.append(
                ModelCard(
                    id=engine.model_name,
                    created=int(server.started_at),
                    root=server.settings.model,
                    max_model_len=engine.max_model_len,
                    tool_call_parser=active_parser(
                        server.settings.tool_call_parser, engine.tokenizer
                    )
                    or "none",
                    structured_outputs=supported_structured_outputs(),
                )
            )
        if server.adapters is not None:
            cards.extend(
                ModelCard(
                    id=a.name,
                    created=int(a.created),
                    root=a.path,
                    parent=engine.model_name,
                    max_model_len=engine.max_model_len,
                )
                for a in server.adapters.visible(principal)
                if allowed is None or a.name in allowed
            )
        return ModelList(data=cards)

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
            resolve_model(request, server, data.model, engine)
        if (data.prompt is None) == (data.messages is None):
            raise invalid_request("Give exactly one of prompt and messages.", "prompt")
        pool = cpu_pool(request)
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
            resolve_model(request, server, data.model, engine)
        vocab = engine.tokenizer.vocab_size
        bad = next((t for t in data.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise invalid_request(
                f"Token id {bad} is out of range: the vocabulary has {vocab} tokens "
                f"(ids 0..{vocab - 1}).",
                "tokens",
            )
        return DetokenizeResponse(prompt=engine.tokenizer.decode(data.tokens))
