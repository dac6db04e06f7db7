"""create_app: the Litestar application — routes, auth, error envelope, lifespans.

Routes: the OpenAI routes (/v1, /tokenize, /detokenize; an API key; /v1/responses in
api/openai/responses/), the Anthropic Messages
API (/v1/messages, its own error body; an API key, also as x-api-key), the admin REST API
(/admin/v1; the admin token; mounted with a database), whatever the caller mounts
(`extra_route_handlers`: `tessera serve` mounts the installed routers of
api/server/plugins.py, i.e. the console at /console), and the open system routes (/health, /version, /metrics — the last behind
--metrics-token and/or the admin token with --metrics-require-admin). OpenAPI at /docs.
Wrong admin or metrics tokens count towards a per-client lockout (api/server/login_throttle.py).

Lifespans: the access layer (api/server/access.py: database, keys, quotas, usage ledger) starts
first and stops last, so in-flight requests drain (api/server/lifespan.py) before their quota
releases finish and the ledger is flushed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from litestar import Litestar
from litestar.datastructures import State
from litestar.openapi import OpenAPIConfig
from litestar.openapi.spec import Components
from litestar.types import ControllerRouterHandler

import engine as engine_pkg
from api.admin.routes import ADMIN_CONTROLLERS, ADMIN_SECURITY_NAME, ADMIN_SECURITY_SCHEME
from api.anthropic.routes import AnthropicController
from api.openai.embeddings import EmbeddingsController
from api.openai.responses.routes import ResponsesController
from api.openai.routes import OpenAIController
from api.server.access import Access
from api.server.affinity import AffinityHeaderMiddleware
from api.server.error_map import error_handlers
from api.server.errors import APIError
from api.server.lifespan import ServerState, make_access_lifespan, make_lifespan
from api.server.metrics import Metrics, MetricsPlugin
from api.server.offload import WorkerPool, WorkerPoolCollector
from api.server.openapi import OfflineSwagger, document_errors_at_startup
from api.server.request_context import RequestIdMiddleware
from api.server.settings import Settings
from api.server.system import SystemController
from api.server.tracing import Tracing
from engine.protocol import EngineClient

logger = logging.getLogger("tessera.api")


def create_app(
    settings: Settings,
    engine: EngineClient | None = None,
    *,
    extra_route_handlers: Sequence[ControllerRouterHandler] = (),
    tracing: Tracing | None = None,
) -> Litestar:
    """The app. Without `engine`, the lifespan loads one from `settings` and stops it on exit;
    a given engine is used as is and left running (its owner shuts it down).

    `extra_route_handlers` mounts other parts. `tracing` (api/server/tracing.py) adds OpenTelemetry
    spans; it is shut down (flushed) with the app. Every response carries X-Request-Id
    (api/server/request_context.py), 404s and errors included."""
    state = ServerState(settings, engine)
    metrics = Metrics(
        settings.model_name,
        max_model_len=settings.max_model_len or 1_000_000,
        key_label=settings.metrics_key_label,
        tenant_label=settings.metrics_tenant_label,
    )
    metrics.tracing = tracing
    if tracing is not None:  # tessera:trace_spans_dropped_total
        tracing.register_metrics(metrics.registry)
    access = Access(settings, metrics)
    if settings.enable_lora:  # the served adapters: --lora-modules and the DB's (api/lora/)
        from api.lora.modules import parse_lora_modules
        from api.lora.registry import AdapterRegistry

        state.adapters = AdapterRegistry(parse_lora_modules(settings.lora_modules), access.db)
        metrics.adapters, metrics.max_loras = state.adapters, settings.max_loras
    handlers: list[ControllerRouterHandler] = [
        OpenAIController,
        EmbeddingsController,
        ResponsesController,
        AnthropicController,
        SystemController,
    ]
    if access.keys is not None:
        handlers.extend(ADMIN_CONTROLLERS)
    cpu_pool = WorkerPool(settings.cpu_workers)  # CPU-heavy request steps (api/server/offload.py)
    metrics.registry.register(WorkerPoolCollector(cpu_pool))
    state.on_engine.append(lambda engine: cpu_pool.start(getattr(engine, "tokenizer", None)))
    app_state = {
        "server": state,
        "engine_stats": lambda: engine_stats(state),
        "cpu_pool": cpu_pool,
    }
    app_state.update(access.state_entries())
    app = Litestar(
        route_handlers=[*handlers, *extra_route_handlers],
        lifespan=[make_access_lifespan(access), make_lifespan(state)],
        on_startup=[document_errors_at_startup],  # the error envelope in the OpenAPI doc
        on_shutdown=[cpu_pool.shutdown, *([tracing.shutdown] if tracing is not None else [])],
        state=State(app_state),
        exception_handlers=error_handlers(APIError.to_body),  # the OpenAI envelope
        plugins=[MetricsPlugin(metrics)],  # GET /metrics, HTTP counters, app.state.metrics
        middleware=[
            AffinityHeaderMiddleware
        ],  # X-Tessera-Affinity for proxies (api/server/affinity.py)
        request_max_body_size=settings.max_body_size,
        openapi_config=OpenAPIConfig(
            title="Tessera",
            version=engine_pkg.__version__,
            description="OpenAI-compatible LLM serving.",
            path="/docs",
            render_plugins=[OfflineSwagger()],  # vendored Swagger UI + CSP (api/server/openapi.py)
            components=Components(security_schemes={ADMIN_SECURITY_NAME: ADMIN_SECURITY_SCHEME}),
        ),
        debug=False,
        logging_config=None,  # ours (api/server/logs.py); Litestar's would replace the root handler
    )
    # Outermost, around Litestar's own exception handling, so that every response has it.
    app.asgi_handler = RequestIdMiddleware(app.asgi_handler, tracing)
    return app


def engine_stats(state: ServerState) -> dict[str, Any]:
    """GET /admin/v1/engine: the engine's queue and KV-cache state now."""
    body: dict[str, Any] = {"phase": state.phase.value, "inflight_requests": state.num_inflight}
    if state.engine is not None:
        s = state.engine.stats()
        body.update(
            model=state.engine.model_name,
            num_running=s.num_running,
            num_waiting=s.num_waiting,
            kv_cache_usage=s.kv_cache_usage,
            num_blocks=s.num_blocks,
            block_size=s.block_size,
            prefix_cache_queries=s.prefix_cache_queries,
            prefix_cache_hits=s.prefix_cache_hits,
            num_preemptions=s.num_preemptions,
            prompt_tokens_total=s.prompt_tokens_total,
            generation_tokens_total=s.generation_tokens_total,
        )
    return body
