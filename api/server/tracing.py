"""OpenTelemetry traces (optional: `pip install tessera[otel]`), named as vLLM names them.

    tracing = Tracing.from_endpoint("http://collector:4318/v1/traces",   # --otlp-traces-endpoint
                                    shutdown_timeout=2.0)                # --otlp-shutdown-timeout
    tracing = Tracing.with_exporter(InMemorySpanExporter())              # tests
    create_app(settings, tracing=tracing)

Spans of one HTTP request:
    "<METHOD> <route>"   SERVER span, from the request head to the end of the response;
                         continues the caller's trace when it sends `traceparent`.
                         Attributes: http.request.method, url.path, http.response.status_code,
                         gen_ai.request.id (the X-Request-Id).
      "llm_request"      one per engine request (n prompts of /v1/completions -> n), from its
                         arrival to its end, with vLLM's attributes: gen_ai.request.id,
                         gen_ai.response.model, gen_ai.usage.prompt_tokens,
                         gen_ai.usage.completion_tokens, gen_ai.latency.time_in_queue,
                         gen_ai.latency.time_to_first_token, gen_ai.latency.e2e,
                         gen_ai.latency.time_in_model_prefill, ..._decode, ..._inference,
                         plus tessera.engine_request_id, tessera.tenant, tessera.finish_reason.
        "queue"          arrival -> first scheduled (the engine's queue_time)
        "prefill"        first scheduled -> first token
        "decode"         first token -> last token
Spans are exported in batches off the request path (api/server/trace_export.py): a full queue or a
slow collector drops spans (tessera:trace_spans_dropped_total), never delays a request, and
shutdown waits at most --otlp-shutdown-timeout seconds for the collector.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from api.server.request_context import RequestRef

if TYPE_CHECKING:
    from api.server.settings import Settings

INSTALL_HINT = (
    "--otlp-traces-endpoint needs the OpenTelemetry packages: pip install 'tessera[otel]' "
    "(opentelemetry-api, opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http)"
)

# Seconds one export to the collector may take (OTEL_EXPORTER_OTLP_[TRACES_]TIMEOUT overrides).
EXPORT_TIMEOUT_S = 5.0
_TIMEOUT_VARIABLES = {"OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"}


class TracingUnavailable(RuntimeError):
    """The opentelemetry packages are not installed."""


@dataclass(slots=True, frozen=True)
class FinishedRequest:
    """One engine request's timeline (time.monotonic() seconds), from api/server/metrics.py."""

    request_id: str  # the engine's
    ref: RequestRef
    model: str
    arrived: float
    first_token: float | None
    finished: float
    queue_time: float | None
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str


def _ns(monotonic: float, now_mono: float, now_ns: int) -> int:
    """A time.monotonic() instant as epoch nanoseconds (spans take wall-clock times)."""
    return now_ns - int((now_mono - monotonic) * 1e9)


class Tracing:
    def __init__(self, provider: Any) -> None:
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.processor: Any = None  # api.server.trace_export.BoundedSpanProcessor, when exporting
        self.tracer = provider.get_tracer("tessera")
        self._kind_server = SpanKind.SERVER
        self._error = Status(StatusCode.ERROR)
        self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def _sdk(cls) -> Any:
        try:
            from opentelemetry.sdk import trace as sdk_trace
            from opentelemetry.sdk.resources import Resource
        except ImportError as exc:
            raise TracingUnavailable(INSTALL_HINT) from exc
        return sdk_trace.TracerProvider(resource=Resource.create({"service.name": "tessera"}))

    @classmethod
    def from_endpoint(cls, endpoint: str, shutdown_timeout: float = 2.0) -> Tracing:
        """Spans to an OTLP/HTTP collector; shutdown waits at most `shutdown_timeout` s for it."""
        provider = cls._sdk()
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            from api.server.trace_export import BoundedSpanProcessor
        except ImportError as exc:
            raise TracingUnavailable(INSTALL_HINT) from exc
        # The SDK's default is 10 s a batch; while a batch waits, later spans queue (or drop).
        timeout = None if _TIMEOUT_VARIABLES & os.environ.keys() else EXPORT_TIMEOUT_S
        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=timeout)
        processor = BoundedSpanProcessor(exporter, shutdown_timeout=shutdown_timeout)
        provider.add_span_processor(processor)
        tracing = cls(provider)
        tracing.processor = processor
        return tracing

    @classmethod
    def with_exporter(cls, exporter: Any) -> Tracing:
        """Spans handed to `exporter` as each ends (SimpleSpanProcessor): for tests."""
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor

        provider = cls._sdk()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        return cls(provider)

    def register_metrics(self, registry: Any) -> None:
        """tessera:trace_spans_dropped_total on `registry` (exporting to a collector only)."""
        if self.processor is not None:
            from api.server.trace_export import SpansDroppedCollector

            registry.register(SpansDroppedCollector(self.processor))

    def shutdown(self) -> None:
        # Sends what is still queued, for at most the processor's shutdown_timeout.
        self.provider.shutdown()

    # -- the server span (api/server/request_context.RequestIdMiddleware) ------------------------------
    @contextlib.contextmanager
    def server_span(self, scope: dict[str, Any], request_id: str) -> Iterator[Any]:
        carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope.get("headers", ())}
        parent = self._propagator.extract(carrier)
        method = scope.get("method", "")
        path = scope.get("path", "")
        attributes = {"http.request.method": method, "url.path": path,
                      "gen_ai.request.id": request_id}  # fmt: skip
        with self.tracer.start_as_current_span(
            f"{method} {path}", context=parent, kind=self._kind_server, attributes=attributes
        ) as span:
            yield span
            route = scope.get("path_template")
            if route:
                span.update_name(f"{method} {route}")
                span.set_attribute("http.route", route)

    def response_started(self, span: Any, status: int) -> None:
        span.set_attribute("http.response.status_code", status)
        if status >= 500:
            span.set_status(self._error)

    def current_context(self) -> Any:
        from opentelemetry import context

        return context.get_current()

    # -- one engine request (api/server/metrics.py calls this when it finishes) ------------------------
    def request_finished(self, r: FinishedRequest) -> None:
        now_mono, now_ns = time.monotonic(), time.time_ns()
        at = lambda t: _ns(t, now_mono, now_ns)  # noqa: E731
        scheduled = r.arrived + r.queue_time if r.queue_time is not None else None
        attributes: dict[str, Any] = {
            "gen_ai.request.id": r.ref.x_request_id or r.request_id,
            "gen_ai.response.model": r.model,
            "gen_ai.usage.prompt_tokens": r.prompt_tokens,
            "gen_ai.usage.completion_tokens": r.completion_tokens,
            "gen_ai.latency.e2e": r.finished - r.arrived,
            "tessera.engine_request_id": r.request_id,
            "tessera.finish_reason": r.finish_reason,
        }
        if r.ref.tenant is not None:
            attributes["tessera.tenant"] = r.ref.tenant
        if r.queue_time is not None:
            attributes["gen_ai.latency.time_in_queue"] = r.queue_time
            attributes["gen_ai.latency.time_in_model_inference"] = r.finished - scheduled
        if r.first_token is not None:
            attributes["gen_ai.latency.time_to_first_token"] = r.first_token - r.arrived
            attributes["gen_ai.latency.time_in_model_decode"] = r.finished - r.first_token
            if scheduled is not None:
                attributes["gen_ai.latency.time_in_model_prefill"] = r.first_token - scheduled
        span = self.tracer.start_span(
            "llm_request", context=r.ref.trace_context, start_time=at(r.arrived),
            attributes=attributes,
        )  # fmt: skip
        if r.finish_reason in ("error", "abort"):
            span.set_status(self._error)
        from opentelemetry import trace

        inside = trace.set_span_in_context(span)
        phases = [("queue", r.arrived, scheduled), ("prefill", scheduled, r.first_token),
                  ("decode", r.first_token, r.finished)]  # fmt: skip
        for name, start, end in phases:
            if start is not None and end is not None and end >= start:
                child = self.tracer.start_span(name, context=inside, start_time=at(start))
                child.end(end_time=at(end))
        span.end(end_time=at(r.finished))


def tracing_from_settings(settings: Settings) -> Tracing | None:
    """None without an endpoint; TracingUnavailable (a clear message) without the packages."""
    endpoint = settings.otlp_traces_endpoint
    if not endpoint:
        return None
    return Tracing.from_endpoint(endpoint, shutdown_timeout=settings.otlp_shutdown_timeout)


__all__ = ["FinishedRequest", "Tracing", "TracingUnavailable", "tracing_from_settings"]
