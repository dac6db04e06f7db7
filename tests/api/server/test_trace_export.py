"""A trace collector that accepts connections and never answers (a plain listening socket)
must neither slow requests nor hold shutdown: spans that cannot be sent are dropped and
counted in tessera:trace_spans_dropped_total, and SIGTERM waits at most
--otlp-shutdown-timeout for the exporter, then says how many spans it dropped."""

from __future__ import annotations

import contextlib
import logging
import signal
import socket
import statistics
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")
pytest.importorskip("opentelemetry.exporter.otlp.proto.http")

from opentelemetry.exporter.otlp.proto.http.trace_exporter import (  # noqa: E402
    OTLPSpanExporter,
)
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from prometheus_client import CollectorRegistry, generate_latest  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from api.server.trace_export import BoundedSpanProcessor, SpansDroppedCollector  # noqa: E402

NO_PROXY = {"NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"}


@contextlib.contextmanager
def hung_collector(max_connections: int = 32) -> Iterator[str]:
    """An OTLP endpoint on loopback that accepts connections, reads nothing and never answers;
    the URL. Accepted connections stay open (at most `max_connections`) until the end."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    listener.settimeout(0.1)  # so that the thread sees `stop`
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            if len(held) < max_connections:
                held.append(conn)
            else:
                conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}/v1/traces"
    finally:
        stop.set()
        thread.join(5)
        listener.close()
        for conn in held:
            conn.close()


def dropped(metrics_text: str) -> dict[str, float]:
    """tessera:trace_spans_dropped_total by reason, from a /metrics body."""
    for family in text_string_to_metric_families(metrics_text):
        if family.name == "tessera:trace_spans_dropped":
            return {s.labels["reason"]: s.value for s in family.samples}
    raise AssertionError("tessera:trace_spans_dropped_total is not exported")


def test_a_hung_collector_never_blocks_spans_and_shutdown_is_bounded(caplog) -> None:
    """The processor on its own, with the real OTLP exporter: ending spans never waits, a full
    queue drops and counts, shutdown returns by its deadline and logs what it dropped."""
    with hung_collector() as endpoint:
        processor = BoundedSpanProcessor(
            OTLPSpanExporter(endpoint=endpoint, timeout=30),
            shutdown_timeout=0.5,
            max_queue_size=4,
            max_batch_size=2,
        )
        registry = CollectorRegistry()
        registry.register(SpansDroppedCollector(processor))
        provider = TracerProvider(shutdown_on_exit=False)
        provider.add_span_processor(processor)
        tracer = provider.get_tracer("test")

        slowest = 0.0
        for i in range(50):
            t0 = time.perf_counter()
            tracer.start_span(f"span-{i}").end()
            slowest = max(slowest, time.perf_counter() - t0)
        # 50 spans, a queue of 4 and an export that hangs: most were dropped, none waited.
        assert slowest < 0.5, f"ending a span took {slowest:.3f} s"
        counts = dropped(generate_latest(registry).decode())
        assert counts["queue_full"] >= 40, counts

        caplog.set_level(logging.WARNING, logger="tessera.api")
        t0 = time.monotonic()
        provider.shutdown()
        took = time.monotonic() - t0
        assert took < 0.5 + 2.0, f"shutdown took {took:.1f} s with a 0.5 s timeout"
        counts = dropped(generate_latest(registry).decode())
        assert counts["shutdown"] >= 1, counts
        # Every span is accounted for: in the collector's hands (none here) or dropped.
        assert sum(counts.values()) == 50, counts
        messages = [r.getMessage() for r in caplog.records]
        assert any(f"dropped {counts['shutdown']:.0f} spans" in m for m in messages), messages


def _completions(server, n: int) -> list[float]:
    """Latencies (s) of n sequential small completions."""
    body = {"model": "tiny", "prompt": "Hi", "max_tokens": 2}
    latencies = []
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        for _ in range(n):
            t0 = time.perf_counter()
            r = client.post("/v1/completions", json=body)
            latencies.append(time.perf_counter() - t0)
            assert r.status_code == 200, r.text
    return latencies


def _sigterm(server) -> tuple[int, float]:
    """(exit code, seconds from SIGTERM to exit)."""
    t0 = time.monotonic()
    server.signal(signal.SIGTERM)
    code = server.proc.wait(timeout=120)
    return code, time.monotonic() - t0


@pytest.mark.slow
def test_a_hung_collector_slows_neither_requests_nor_shutdown(start_server, tiny_llama_dir) -> None:
    """Two real servers, one after the other: without tracing, and exporting to a collector
    that never answers with a 4-span queue. Same requests, compared within this run."""
    args = ("--auth", "none", "--served-model-name", "tiny")
    plain = start_server(tiny_llama_dir, *args, env=NO_PROXY)
    _completions(plain, 3)  # warm up
    plain_latency = statistics.median(_completions(plain, 20))
    code, plain_exit = _sigterm(plain)
    assert code == 0

    timeout = 1.0
    with hung_collector() as endpoint:
        # A queue of 4 and batches of 2: each request's 5 spans overflow it while the
        # exporter's thread waits on the collector (5 s a batch).
        env = {**NO_PROXY, "OTEL_BSP_MAX_QUEUE_SIZE": "4", "OTEL_BSP_MAX_EXPORT_BATCH_SIZE": "2"}
        traced = start_server(
            tiny_llama_dir, *args, "--otlp-traces-endpoint", endpoint,
            "--otlp-shutdown-timeout", str(timeout), env=env,
        )  # fmt: skip
        _completions(traced, 3)
        before = dropped(httpx.get(traced.base_url + "/metrics", timeout=10).text)
        traced_latency = statistics.median(_completions(traced, 20))
        after = dropped(httpx.get(traced.base_url + "/metrics", timeout=10).text)
        code, traced_exit = _sigterm(traced)
    log = traced.log(tail=None)

    assert after["queue_full"] > before["queue_full"], (before, after)
    # No wait on the collector on the request path (an export waits up to 5 s).
    assert traced_latency <= 3 * plain_latency + 0.05, (traced_latency, plain_latency)
    assert code == 0, log[-3000:]
    # The shutdown waited for the collector at most the timeout, plus noise.
    assert traced_exit - plain_exit <= timeout + 5.0, (traced_exit, plain_exit)
    assert "Trace export did not finish within 1.0 s of shutdown" in log, log[-3000:]
    assert "spans not yet accepted by the collector" in log
