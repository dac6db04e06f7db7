"""Prometheus metrics: vLLM's names (so its Grafana dashboards and autoscaling rules work
unchanged) plus Tessera's own under `tessera:`.

    metrics = Metrics(model_name, registry=None, stats=engine.stats)
    metrics.request_started(request_id, key_name=None)
    metrics.observe(request_id, output)            # each cumulative RequestOutput, in order
    metrics.request_aborted(request_id)            # the client left before the engine finished
    metrics.rejected("quota" | "admission", reason)
    metrics.login_failure(surface) / login_lockout(surface)   # api/server/login_throttle.py
    metrics.render() -> bytes                      # the /metrics body (CONTENT_TYPE)

    Litestar(..., plugins=[MetricsPlugin(metrics)])  # GET /metrics, HTTP counting, state.metrics

`observe` is the usual entry point: it derives first_token / tokens / request_finished from
the cumulative outputs, which are also public for callers that track requests themselves.

Engine state (running / waiting, KV usage, prefix cache, preemptions, prompt and generation
token counters) is read from `stats()` at scrape time, so it is never stale and costs nothing
per step. Request-level series (request_success, the latency and length histograms, per-key
usage) are observed by the request path. Nothing is global: every Metrics has its own
registry unless one is passed in.

Who can be told apart in /metrics is the operator's choice, off by default (/metrics is often
reachable by more people than the admin API): `key_label` names the label of
tessera:requests / tessera:tokens (none: one series for all keys; name: key_name; id:
key_id), `tenant_label` whether the tessera:*_by_tenant families exist (none) or carry the
engine's opaque tenant id (id). /metrics itself may ask for a bearer token (--metrics-token,
or the admin token with --metrics-require-admin).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from litestar import Request, Response, get
from litestar.config.app import AppConfig
from litestar.middleware import DefineMiddleware
from litestar.plugins import InitPluginProtocol
from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client import values as prometheus_values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from api.server.request_context import RequestRef, snapshot

if TYPE_CHECKING:
    from engine.outputs import RequestOutput
    from engine.stats import EngineStats

_MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
# The classic text format (0.0.4): what generate_latest writes and every Prometheus reads.
# Litestar appends "; charset=utf-8" to text/* media types.
CONTENT_TYPE = "text/plain; version=0.0.4"
FINISH_REASONS = ("stop", "length", "abort", "error", "timeout")
REJECTION_KINDS = ("quota", "admission")
KEY_LABELS = ("none", "name", "id")  # --metrics-key-label
TENANT_LABELS = ("none", "id")  # --metrics-tenant-label
LOGIN_SURFACES = ("console", "admin_api", "metrics", "api")  # api/server/login_throttle.py

# vLLM's buckets (vllm/v1/metrics/loggers.py), so dashboards' quantiles line up.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


def buckets_1_2_5(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to limit (vLLM's token-count buckets)."""
    out: list[float] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(float(m * scale))
        scale *= 10


@dataclass(slots=True)
class _Live:
    """What the metrics know of one request in flight."""

    started: float  # time.monotonic()
    key_name: str | None
    ref: RequestRef | None = (
        None  # X-Request-Id, tenant, trace context (api/server/request_context.py)
    )
    first_token_at: float | None = None
    key_label: str | None = None  # the per-key series' label value: the name, or the id
    last_token: float | None = None
    prompt_tokens: int = 0
    generation_tokens: int = 0


class _EngineCollector(Collector):
    """Engine gauges and counters, read from the engine's stats snapshot at scrape time."""

    def __init__(
        self, model_name: str, stats: Callable[[], EngineStats | None], by_tenant: bool = False
    ) -> None:
        self.model_name = model_name
        self.stats = stats
        self.by_tenant = by_tenant  # the tessera:*_by_tenant families (--metrics-tenant-label id)

    def collect(self) -> Iterator[Metric]:
        s = self.stats()
        if s is None:  # the engine is still loading: absent beats a misleading zero
            return
        label = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> Metric:
            m = GaugeMetricFamily(name, doc, labels=["model_name"])
            m.add_metric(label, value)
            return m

        def counter(name: str, doc: str, value: float) -> Metric:
            m = CounterMetricFamily(name, doc, labels=["model_name"])
            m.add_metric(label, value)
            return m

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", s.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to run.", s.num_waiting)
        yield gauge(
            "vllm:kv_cache_usage_perc",
            "Fraction of KV-cache blocks in use (0..1).",
            s.kv_cache_usage,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            s.prefix_cache_queries,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            s.prefix_cache_hits,
        )
        yield counter("vllm:num_preemptions", "Preemptions of running requests.", s.num_preemptions)
        yield counter(
            "vllm:prompt_tokens", "Prompt tokens computed (prefill).", s.prompt_tokens_total
        )
        yield counter("vllm:generation_tokens", "Tokens generated.", s.generation_tokens_total)
        yield gauge("tessera:kv_cache_blocks", "KV-cache blocks in the pool.", s.num_blocks)
        if s.spec_decode_accepted_per_pos:  # speculative decoding is on
            yield from _spec_decode_counters(label, s)
        if self.by_tenant:
            yield from _tenant_counters(label, s.tenants)
        yield gauge(
            "tessera:engine_loop_alive", "1 while the engine step loop runs.", int(s.loop_alive)
        )


def _spec_decode_counters(label: list[str], s: EngineStats) -> Iterator[Metric]:
    """vLLM's speculative-decoding counters; acceptance rate = accepted / draft tokens."""
    for name, doc, value in (
        (
            "vllm:spec_decode_num_drafts",
            "Requests scheduled with drafts, per step.",
            s.spec_decode_num_drafts,
        ),
        (
            "vllm:spec_decode_num_draft_tokens",
            "Draft tokens proposed.",
            s.spec_decode_num_draft_tokens,
        ),
        (
            "vllm:spec_decode_num_accepted_tokens",
            "Draft tokens accepted.",
            s.spec_decode_num_accepted_tokens,
        ),
    ):
        m = CounterMetricFamily(name, doc, labels=["model_name"])
        m.add_metric(label, value)
        yield m
    m = CounterMetricFamily(
        "tessera:spec_decode_controller_steps",
        "Decode steps the draft controller decided, by decision (draft or plain).",
        labels=["model_name", "decision"],
    )
    m.add_metric([*label, "draft"], s.spec_decode_controller_draft_steps)
    m.add_metric([*label, "plain"], s.spec_decode_controller_plain_steps)
    yield m
    m = CounterMetricFamily(
        "vllm:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted, by position in their proposal (0-based).",
        labels=["model_name", "position"],
    )
    for pos, value in enumerate(s.spec_decode_accepted_per_pos):
        m.add_metric([*label, str(pos)], value)
    yield m


_TENANT_SERIES = (
    ("tessera:prefix_cache_queries_by_tenant", "Prompt tokens looked up in the prefix cache."),
    ("tessera:prefix_cache_hits_by_tenant", "Prompt tokens found in the prefix cache."),
    ("tessera:generation_tokens_by_tenant", "Tokens generated."),
)


def _tenant_counters(label: list[str], tenants: dict[str, tuple[int, ...]]) -> Iterator[Metric]:
    """Per tenant (the engine's tenant id: the key's tenant): a tenant's
    hits stay within its own salted cache, so hits / queries is its own hit rate."""
    for i, (name, doc) in enumerate(_TENANT_SERIES):
        m = CounterMetricFamily(name, doc + " By tenant.", labels=["model_name", "tenant"])
        for tenant, values in tenants.items():
            m.add_metric([*label, tenant], values[i])
        yield m


class _LoRACollector(Collector):
    """vLLM's vllm:lora_requests_info: one series whose labels name the adapters in use
    (value: the scrape time). running_lora_adapters lists the adapters of the requests in
    flight (running or waiting: the engine does not split them per adapter), comma-separated;
    waiting_lora_adapters stays empty. Absent without --enable-lora."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        adapters = self.metrics.adapters
        if adapters is None:
            return
        m = GaugeMetricFamily(
            "vllm:lora_requests_info",
            "LoRA adapters of the requests in flight (labels); the value is the scrape time.",
            labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
        )
        m.add_metric([str(self.metrics.max_loras), "", ",".join(adapters.active)], time.time())
        yield m


class Metrics:
    def __init__(
        self,
        model_name: str,
        registry: CollectorRegistry | None = None,
        *,
        stats: Callable[[], EngineStats | None] | None = None,
        max_model_len: int = 1_000_000,
        key_label: str = "none",
        tenant_label: str = "none",
    ) -> None:
        if key_label not in KEY_LABELS:
            raise ValueError(f"key_label must be one of {', '.join(KEY_LABELS)}; got {key_label!r}")
        if tenant_label not in TENANT_LABELS:
            raise ValueError(
                f"tenant_label must be one of {', '.join(TENANT_LABELS)}; got {tenant_label!r}"
            )
        # tessera:requests / tokens: one series for all keys (none), or per key_name / key_id.
        self.key_label = key_label
        self.tenant_label = tenant_label
        key = {"none": [], "name": ["key_name"], "id": ["key_id"]}[key_label]
        if registry is None:
            registry = CollectorRegistry()
            ProcessCollector(registry=registry)
            PlatformCollector(registry=registry)
            GCCollector(registry=registry)
        self.model_name = model_name
        self.registry = registry
        self._stats: Callable[[], EngineStats | None] = stats or (lambda: None)
        self.has_stats = stats is not None
        self._live: dict[str, _Live] = {}
        self.tracing: Any = (
            None  # api.server.tracing.Tracing: an llm_request span per finished request
        )
        by_tenant = tenant_label == "id"
        # Computed at scrape time (the core's stats, the adapters of the requests in flight):
        # with several API server processes, a scrape adds these to the request series summed
        # over the processes' files (render()); the stats are every process's alike, the
        # adapters in flight the answering process's.
        self._shared_collectors: list[Collector] = [
            _EngineCollector(model_name, lambda: self._stats(), by_tenant),
            _LoRACollector(self),
        ]
        # The served LoRA adapters (api/lora/registry.py), set by the app with --enable-lora.
        self.adapters: Any = None
        self.max_loras = 0
        for collector in self._shared_collectors:
            registry.register(collector)
        self._multiprocess_registry: CollectorRegistry | None = None
        m = ["model_name"]

        def hist(name: str, doc: str, buckets: Any) -> Histogram:
            return Histogram(name, doc, m, buckets=buckets, registry=registry)

        # prometheus-client appends `_total` to counters: vllm:request_success_total.
        self.request_success = Counter(
            "vllm:request_success",
            "Finished requests by finish reason.",
            [*m, "finished_reason"],
            registry=registry,
        )
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Time between generated tokens.", ITL_BUCKETS
        )
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        # The series fed once a streamed token, looked up once (labels() costs a lock and a
        # dict lookup a call).
        self._ttft = self.ttft.labels(model_name)
        self._itl = self.itl.labels(model_name)
        self.queue_time = hist(
            "vllm:request_queue_time_seconds", "Time waiting to be scheduled.", LATENCY_BUCKETS
        )
        token_buckets = buckets_1_2_5(max_model_len)
        self.prompt_len = hist(
            "vllm:request_prompt_tokens", "Prompt length of finished requests.", token_buckets
        )
        self.generation_len = hist(
            "vllm:request_generation_tokens",
            "Tokens generated per finished request.",
            token_buckets,
        )
        self.key_requests = Counter(
            "tessera:requests",
            "Finished engine requests (one per prompt); per API key with --metrics-key-label.",
            key,
            registry=registry,
        )
        self.key_tokens = Counter(
            "tessera:tokens",
            "Tokens (kind: prompt or generation); per API key with --metrics-key-label.",
            [*key, "kind"],
            registry=registry,
        )
        self.quota_rejections = Counter(
            "tessera:quota_rejections",
            "Requests refused by a key's quota or rate limit (rpm, tpm, parallel, budget).",
            ["reason"],
            registry=registry,
        )
        self.admission_rejections = Counter(
            "tessera:admission_rejections",
            "Requests refused by admission (queue_full, draining, loading, engine_dead).",
            ["reason"],
            registry=registry,
        )
        self.http_requests = Counter(
            "tessera:http_requests",
            "HTTP requests by matched route template, method and status.",
            ["route", "method", "status"],
            registry=registry,
        )
        self.login_failures = Counter(
            "tessera:login_failures",
            "Wrong secrets sent to the console login, the admin API, /metrics, or to an API "
            "route when not shaped like an API key (a guess at the admin token), by surface.",
            ["surface"],
            registry=registry,
        )
        self.login_lockouts = Counter(
            "tessera:login_lockouts",
            "Clients locked out after too many failed attempts (--login-max-failures), by the "
            "surface of the attempt that started the lockout.",
            ["surface"],
            registry=registry,
        )
        for surface in LOGIN_SURFACES:  # present at 0, so that alerts see the first one
            self.login_failures.labels(surface)
            self.login_lockouts.labels(surface)

    def bind_stats(self, stats: Callable[[], EngineStats | None]) -> None:
        """Point the engine series at an engine's stats() (once it has loaded)."""
        self._stats = stats
        self.has_stats = True

    # -- the request path -----------------------------------------------------------------------

    def request_started(
        self, request_id: str, key_name: str | None = None, key_id: str | None = None
    ) -> None:
        # Called in the HTTP request's task: its ids (and trace context) are the current ones.
        trace_context = self.tracing.current_context() if self.tracing is not None else None
        label = {"none": None, "name": key_name, "id": key_id}[self.key_label]
        self._live[request_id] = _Live(
            time.monotonic(), key_name, ref=snapshot(trace_context), key_label=label
        )

    def first_token(self, request_id: str) -> None:
        live = self._live.get(request_id)
        if live is None or live.last_token is not None:
            return
        live.last_token = live.first_token_at = time.monotonic()
        self._ttft.observe(live.last_token - live.started)

    def tokens(self, request_id: str, n: int) -> None:
        """n more tokens arrived together (after the first): n inter-token observations of
        the interval split evenly, so the count is generated tokens - 1 per request."""
        live = self._live.get(request_id)
        if live is None or n <= 0:
            return
        now = time.monotonic()
        if live.last_token is None:
            self.first_token(request_id)
            n -= 1
            if n <= 0:
                return
        gap = (now - live.last_token) / n
        for _ in range(n):
            self._itl.observe(gap)
        live.last_token = now

    def request_finished(
        self,
        request_id: str,
        finished_reason: str,
        prompt_tokens: int,
        generation_tokens: int,
        queue_time: float | None = None,
        key_name: str | None = None,
    ) -> None:
        if finished_reason not in FINISH_REASONS:
            raise ValueError(
                f"finished_reason must be one of {', '.join(FINISH_REASONS)}; "
                f"got {finished_reason!r}"
            )
        live = self._live.pop(request_id, None)
        if live is not None:
            key_name = key_name or live.key_label
            finished = time.monotonic()
            self.e2e.labels(self.model_name).observe(finished - live.started)
            if self.tracing is not None and live.ref is not None:
                self._trace(request_id, live, finished, finished_reason, prompt_tokens,
                            generation_tokens, queue_time)  # fmt: skip
        self.request_success.labels(self.model_name, finished_reason).inc()
        self.prompt_len.labels(self.model_name).observe(prompt_tokens)
        self.generation_len.labels(self.model_name).observe(generation_tokens)
        if queue_time is not None:
            self.queue_time.labels(self.model_name).observe(queue_time)
        if self.key_label == "none":
            self.key_requests.inc()
            self.key_tokens.labels("prompt").inc(prompt_tokens)
            self.key_tokens.labels("generation").inc(generation_tokens)
        elif key_name is not None:
            self.key_requests.labels(key_name).inc()
            self.key_tokens.labels(key_name, "prompt").inc(prompt_tokens)
            self.key_tokens.labels(key_name, "generation").inc(generation_tokens)

    def observe(self, request_id: str, output: RequestOutput) -> None:
        """Feed one cumulative RequestOutput of a started request; finishes it when done."""
        live = self._live.get(request_id)
        if live is None:
            return
        generated = sum(len(c.token_ids) for c in output.outputs)
        live.prompt_tokens = len(output.prompt_token_ids)
        if generated > live.generation_tokens:
            self.tokens(request_id, generated - live.generation_tokens)
            live.generation_tokens = generated
        if output.finished:
            reasons = [c.finish_reason for c in output.outputs if c.finish_reason]
            reason = "error" if output.error else _overall_reason(reasons)
            self.request_finished(
                request_id, reason, live.prompt_tokens, generated, queue_time=output.queue_time
            )

    def request_aborted(self, request_id: str) -> None:
        """The request ended before the engine said so (client gone, shutdown): abort."""
        live = self._live.get(request_id)
        if live is not None:
            self.request_finished(request_id, "abort", live.prompt_tokens, live.generation_tokens)

    def rejected(self, kind: str, reason: str) -> None:
        if kind == "quota":
            self.quota_rejections.labels(reason).inc()
        elif kind == "admission":
            self.admission_rejections.labels(reason).inc()
        else:
            raise ValueError(f"kind must be one of {', '.join(REJECTION_KINDS)}; got {kind!r}")

    def http_request(self, route: str, method: str, status: int) -> None:
        self.http_requests.labels(route, method, str(status)).inc()

    def login_failure(self, surface: str) -> None:
        self.login_failures.labels(surface).inc()

    def login_lockout(self, surface: str) -> None:
        self.login_lockouts.labels(surface).inc()

    def _trace(
        self, request_id: str, live: _Live, finished: float, reason: str, prompt: int,
        generated: int, queue_time: float | None,
    ) -> None:  # fmt: skip
        from api.server.tracing import FinishedRequest

        assert live.ref is not None
        done = FinishedRequest(request_id, live.ref, self.model_name, live.started,
                               live.first_token_at, finished, queue_time, prompt, generated,
                               reason)  # fmt: skip
        try:
            self.tracing.request_finished(done)
        except Exception:  # noqa: BLE001 - a tracing failure must not fail the request
            logging.getLogger(__name__).exception("could not record the span of %s", request_id)

    def request_ref(self, request_id: str) -> RequestRef | None:
        """The X-Request-Id and tenant of an engine request in flight (the console)."""
        live = self._live.get(request_id)
        return live.ref if live is not None else None

    def key_name(self, request_id: str) -> str | None:
        """The API key name of a request in flight, if the request path gave one."""
        live = self._live.get(request_id)
        return live.key_name if live is not None else None

    @property
    def num_live(self) -> int:
        return len(self._live)

    def render(self) -> bytes:
        """The /metrics body. With several API server processes (multiprocess_dir()): their
        request series summed, and the shared collectors' series; what only this process
        knows (process_*, its request pool's CPU, its trace export) is left out, as a scrape
        reaches one process of several."""
        directory = multiprocess_dir()
        if directory is None:
            return generate_latest(self.registry)
        if self._multiprocess_registry is None:
            registry = CollectorRegistry()
            MultiProcessCollector(registry, path=directory)
            for collector in self._shared_collectors:
                registry.register(collector)
            self._multiprocess_registry = registry
        return generate_latest(self._multiprocess_registry)


def enable_multiprocess_metrics(directory: str) -> None:
    """Counters and histograms made from now on, here and in processes started from here,
    keep their values in files in `directory` (prometheus_client's multiprocess mode), which
    render() sums: the API server processes of one server (--api-server-count) share it."""
    os.environ[_MULTIPROC_ENV] = directory
    prometheus_values.ValueClass = prometheus_values.MultiProcessValue()


def multiprocess_dir() -> str | None:
    """The multiprocess directory, where this process's metric values live in files."""
    if prometheus_values.ValueClass is prometheus_values.MutexValue:
        return None
    return os.environ.get(_MULTIPROC_ENV)


def _overall_reason(reasons: list[str]) -> str:
    """One reason for a request with n samples: the most severe one."""
    for reason in ("error", "timeout", "abort", "length", "stop"):
        if reason in reasons:
            return reason
    return "stop"


# -- HTTP: the /metrics route and the request-counting middleware --------------------------------


def metrics_of(app: Any) -> Metrics | None:
    return getattr(app.state, "metrics", None)


@get("/metrics", include_in_schema=False, sync_to_thread=False, cache=False)
def metrics_handler(request: Request) -> Response[bytes]:
    """The Prometheus text format. With --metrics-token (and/or --metrics-require-admin),
    only for `Authorization: Bearer <that token>`: else 401 in the OpenAI envelope."""
    app = request.app
    server = getattr(app.state, "server", None)
    settings = getattr(server, "settings", None) or getattr(app.state, "settings", None)
    if settings is not None:
        _authorize_scrape(request, settings)
    metrics = metrics_of(app)
    if metrics is None:
        return Response(b"", status_code=503, media_type=CONTENT_TYPE)
    return Response(metrics.render(), media_type=CONTENT_TYPE)


def _authorize_scrape(request: Request, settings: Any) -> None:
    """--metrics-token and --metrics-require-admin: either token opens /metrics. Wrong tokens
    count towards the client's lockout (api/server/login_throttle.py), like the console's login."""
    from api.keys.auth import parse_bearer
    from api.server.errors import invalid_api_key
    from api.server.login_throttle import check_secret

    token = getattr(settings, "metrics_token", None)
    admin = bool(getattr(settings, "metrics_require_admin", False))
    if not token and not admin:
        return
    header = request.headers.get("authorization")
    wanted = "the metrics token" if token else "the admin token"

    def verify() -> None:
        if not header:
            raise invalid_api_key(f"/metrics needs {wanted}: send `Authorization: Bearer <token>`.")
        given = parse_bearer(header)
        if token and _same_secret(given, token):
            return
        if admin:
            request.app.state.authenticator.authenticate_admin(header)  # 401 if not it
            return
        raise invalid_api_key("Incorrect metrics token provided.")

    # A right metrics token does not clear the client's failures: it is not the admin token.
    check_secret(request, "metrics", verify, attempted=bool(header), clear=False)


def _same_secret(given: str, expected: str) -> bool:
    """Constant time: fixed-length digests, so neither content nor length leaks."""
    a = hashlib.sha256(given.encode()).digest()
    return hmac.compare_digest(a, hashlib.sha256(expected.encode()).digest())


class HTTPMetricsMiddleware:
    """Counts every routed HTTP request by its route template (never the raw path, so the
    label set stays bounded), method and response status."""

    def __init__(self, app: Any, metrics: Metrics | None = None) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # an exception that escapes every handler

        async def send_wrapper(message: Any) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_wrapper)
        finally:
            metrics = self.metrics or metrics_of(scope["app"])
            if metrics is not None:
                route = scope.get("path_template") or "unmatched"
                metrics.http_request(route, scope.get("method", ""), status)


class MetricsPlugin(InitPluginProtocol):
    """Wires a Metrics into an app: GET /metrics, HTTPMetricsMiddleware, app.state.metrics.

    Unless the Metrics was given a stats source, it reads the engine of app.state.server
    (api.server.lifespan.ServerState) at scrape time, so an engine that loads later is picked up."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def on_app_init(self, app_config: AppConfig) -> AppConfig:
        app_config.route_handlers.append(metrics_handler)
        app_config.middleware.append(DefineMiddleware(HTTPMetricsMiddleware, metrics=self.metrics))
        app_config.state["metrics"] = self.metrics
        server = app_config.state.get("server")
        if not self.metrics.has_stats and server is not None:
            self.metrics.bind_stats(lambda: server.engine.stats() if server.engine else None)
        return app_config
