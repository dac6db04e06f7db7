"""POST /v1/embeddings: OpenAI's embeddings API on a server started with --runner pooling.

The body's `input` (a string, strings, token ids or lists of them) becomes one engine
request per input, pooled instead of sampled (engine.pooling_params; the vector is the
model's pooling of its final hidden states). The same guards as generation: the key's auth
and model access (403 / 404), its quotas (the inputs' tokens reserved), admission (503),
one usage row per request with the prompt tokens and no completion tokens. A generating
server answers 400 naming --runner pooling; `dimensions` is refused (400) unless the model
is Matryoshka-capable; an input over max_model_len is a 400 unless `truncate_prompt_tokens`
keeps its last tokens (vLLM's).
"""

from __future__ import annotations

import base64
import time
import uuid
from typing import Any

from litestar import Request, post
from litestar.di import NamedDependency
from litestar.params import JSONBody

from api.keys.auth import Principal
from api.openai.formatting import check_complete
from api.openai.inputs import completion_prompts
from api.openai.request_fields import check_fields
from api.openai.schemas import EmbeddingData, EmbeddingRequest, EmbeddingResponse, EmbeddingUsage
from api.openai.serving import (
    admit,
    cpu_pool,
    open_ticket,
    require_engine,
    require_runner,
    resolve_model,
    run_to_end,
)
from api.server.deps import ClientController
from api.server.errors import invalid_request
from api.server.lifespan import ServerState
from engine.outputs import RequestOutput
from engine.pooling_params import PoolingParams
from engine.sampling_params import SamplingParams


class EmbeddingsController(ClientController):
    tags = ["OpenAI"]

    @post("/v1/embeddings", status_code=200)
    async def embeddings(
        self,
        data: JSONBody[EmbeddingRequest],
        request: Request,
        server: NamedDependency[ServerState],
        principal: NamedDependency[Principal],
    ) -> EmbeddingResponse:
        """One embedding per input, pooled as the model's config says (--runner pooling)."""
        arrived = time.monotonic()
        lenient = server.settings.lenient_request_fields
        check_fields(await request.body(), "embedding", lenient=lenient)
        engine = require_engine(server, request)
        adapter = resolve_model(request, server, data.model, engine)
        require_runner(engine, "pooling")
        if adapter is not None:  # (a pooling server loads none: LoRA is refused with it)
            raise invalid_request("LoRA adapters do not embed: name the served model.", "model")
        pooling = pooling_params(data, engine)
        prompts, _ = await completion_prompts(
            data.input,
            engine.tokenizer,
            server.settings.max_prompts_per_request,
            cpu_pool(request),
            param="input",
        )
        prompts = fit_inputs(prompts, data.truncate_prompt_tokens, engine.max_model_len)
        eid = f"embd-{uuid.uuid4().hex}"
        rids = [eid] if len(prompts) == 1 else [f"{eid}-{i}" for i in range(len(prompts))]
        reserved = sum(len(p) for p in prompts)  # nothing is generated
        ticket = await open_ticket(request, principal, eid, data, reserved, arrived)
        gen = await admit(
            server, engine, request, principal, ticket, rids, prompts, SamplingParams(),
            pooling=pooling,
        )  # fmt: skip
        fmt = EmbeddingFormatter(engine.model_name, data.encoding_format)
        return await run_to_end(gen, request, ticket, fmt)


def pooling_params(data: EmbeddingRequest, engine: Any) -> PoolingParams:
    """The body's `dimensions` checked against the model (400 naming it)."""
    try:
        params = PoolingParams(dimensions=data.dimensions)
        if engine.pooler is not None:
            engine.pooler.check_dimensions(params.dimensions)
    except ValueError as e:
        raise invalid_request(str(e), "dimensions") from None
    return params


def fit_inputs(prompts: list[list[int]], truncate: int | None, limit: int) -> list[list[int]]:
    """Each input within max_model_len: its last `truncate` tokens (-1: max_model_len) where
    asked, else a 400 for one that is longer; an empty input is a 400."""
    if truncate is not None:
        if truncate == -1:
            truncate = limit
        if not 1 <= truncate <= limit:
            raise invalid_request(
                f"truncate_prompt_tokens must be -1 or between 1 and max_model_len ({limit}), "
                f"got {truncate}.",
                "truncate_prompt_tokens",
            )
        prompts = [p[-truncate:] for p in prompts]
    for i, p in enumerate(prompts):
        if not p:
            raise invalid_request(
                f"input {i} is empty: it must contain at least one token.", "input"
            )
        if len(p) > limit:
            raise invalid_request(
                f"This model's maximum context length is {limit} tokens; input {i} has "
                f"{len(p)} tokens. Shorten it, or set truncate_prompt_tokens to keep its last "
                "tokens.",
                "input",
            )
    return prompts


class EmbeddingFormatter:
    """The engine's pooled vectors as OpenAI's embedding list (run_to_end's `fmt`)."""

    def __init__(self, model: str, encoding_format: str) -> None:
        self.model = model
        self.encoding_format = encoding_format

    def response(
        self, outputs: list[RequestOutput | None], prompts: list[list[int]]
    ) -> EmbeddingResponse:
        check_complete(outputs)
        data = [
            EmbeddingData(index=i, embedding=self._encode(out.pooled))
            for i, out in enumerate(outputs)
            if out is not None
        ]
        n = sum(len(p) for p in prompts)
        return EmbeddingResponse(data=data, model=self.model, usage=EmbeddingUsage(n, n))

    def _encode(self, vector: Any) -> list[float] | str:
        if self.encoding_format == "base64":  # OpenAI's: little-endian float32 bytes
            return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
        return vector.tolist()
