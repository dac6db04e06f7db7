"""Span export that never waits on the collector (api/server/tracing.py builds it for
`--otlp-traces-endpoint`; needs the `otel` extra).

    processor = BoundedSpanProcessor(OTLPSpanExporter(...), shutdown_timeout=2.0)
    provider.add_span_processor(processor)
    registry.register(SpansDroppedCollector(processor))   # tessera:trace_spans_dropped_total

The SDK's BatchSpanProcessor does the same batching, but its shutdown waits for the exporter
(a collector that accepts connections and never answers held SIGTERM for 10-30 s) and its
drops are not counted anywhere Prometheus can see. Here:

- `on_end` (the request path) only appends to a bounded queue: when the queue is full the span
  is dropped and counted (`queue_full`), never waited for.
- One daemon thread exports batches: every `schedule_delay_s`, or at once when a batch is full.
  An export that fails (the collector refused it, or it timed out) drops its spans
  (`export_failed`).
- `shutdown()` gives the thread `shutdown_timeout` seconds to send what is queued; what is
  still queued or being sent then is dropped (`shutdown`), logged as a WARNING with its count,
  and the thread is left behind: it is a daemon, so it cannot hold the process's exit.

The queue, batch and delay sizes honour the SDK's variables: OTEL_BSP_MAX_QUEUE_SIZE (2048),
OTEL_BSP_MAX_EXPORT_BATCH_SIZE (512), OTEL_BSP_SCHEDULE_DELAY (5000 ms).
"""

from __future__ import annotations

import collections
import logging
import os
import threading
import time
from collections.abc import Iterator
from typing import Any

from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import Collector

logger = logging.getLogger("tessera.api")

DROP_REASONS = ("queue_full", "export_failed", "shutdown")
_WARN_EVERY_S = 60.0  # a full queue is logged at most once a minute; the counter has every drop


def _env_int(name: str, default: int) -> int:
    try:
        value = int(os.environ.get(name, default))
    except ValueError:
        logger.warning("%s is not an integer; using %d", name, default)
        return default
    return value if value > 0 else default


class BoundedSpanProcessor(SpanProcessor):
    def __init__(
        self,
        exporter: SpanExporter,
        *,
        shutdown_timeout: float = 2.0,
        max_queue_size: int | None = None,
        max_batch_size: int | None = None,
        schedule_delay_s: float | None = None,
    ) -> None:
        self.exporter = exporter
        self.shutdown_timeout = shutdown_timeout
        self.max_queue_size = max_queue_size or _env_int("OTEL_BSP_MAX_QUEUE_SIZE", 2048)
        batch = max_batch_size or _env_int("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", 512)
        self.max_batch_size = min(batch, self.max_queue_size)
        if schedule_delay_s is None:
            schedule_delay_s = _env_int("OTEL_BSP_SCHEDULE_DELAY", 5000) / 1000
        self.schedule_delay_s = schedule_delay_s
        self.dropped = dict.fromkeys(DROP_REASONS, 0)  # spans, by reason; under _lock
        self._queue: collections.deque[ReadableSpan] = collections.deque()
        self._lock = threading.Lock()  # held only to move spans and counts, never to export
        self._idle = threading.Condition(self._lock)  # notified after each batch (force_flush)
        self._wake = threading.Event()
        self._in_flight = 0  # spans in the export under way
        self._closing = False
        self._abandoned = False  # shutdown gave up on the thread; its last export is not counted
        self._exporter_closed = False
        self._warned_at: float | None = None
        self._thread = threading.Thread(target=self._run, name="tessera-span-export", daemon=True)
        self._thread.start()

    # -- the request path: never waits ----------------------------------------------------------
    def on_start(self, span: Any, parent_context: Any = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if not (span.context and span.context.trace_flags.sampled):
            return
        with self._lock:
            if self._closing:
                self.dropped["shutdown"] += 1
                return
            if len(self._queue) >= self.max_queue_size:
                self.dropped["queue_full"] += 1
                warn = self._warned_at is None or time.monotonic() - self._warned_at > _WARN_EVERY_S
                if warn:
                    self._warned_at = time.monotonic()
            else:
                self._queue.append(span)
                warn = False
                if len(self._queue) >= self.max_batch_size:
                    self._wake.set()
        if warn:
            logger.warning(
                "Span export queue full (%d spans): dropping spans while the trace collector "
                "is slow or unreachable (counted in tessera:trace_spans_dropped_total)",
                self.max_queue_size,
            )

    # -- the export thread ----------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait(self.schedule_delay_s)
            self._wake.clear()
            while self._export_one_batch():
                pass
            with self._lock:
                if self._abandoned:
                    return
                if self._closing and not self._queue:
                    break
        self._close_exporter()

    def _close_exporter(self) -> None:
        """The exporter's shutdown, once (it also stops its retries of an export under way)."""
        with self._lock:
            if self._exporter_closed:
                return
            self._exporter_closed = True
        try:
            self.exporter.shutdown()
        except Exception:  # noqa: BLE001 - shutting down anyway
            logger.exception("Span exporter shutdown failed")

    def _export_one_batch(self) -> bool:
        """Send up to one batch; False when there was nothing to send or shutdown gave up."""
        with self._lock:
            if self._abandoned or not self._queue:
                return False
            n = min(len(self._queue), self.max_batch_size)
            batch = [self._queue.popleft() for _ in range(n)]
            self._in_flight = n
        try:
            ok = self.exporter.export(batch) == SpanExportResult.SUCCESS
        except Exception:  # noqa: BLE001 - an exporter bug must not end the thread
            logger.exception("Span export failed")
            ok = False
        with self._lock:
            if self._abandoned:  # shutdown already counted these spans as dropped
                return False
            self._in_flight = 0
            if not ok:
                self.dropped["export_failed"] += n
            self._idle.notify_all()
        return True

    # -- the end --------------------------------------------------------------------------------
    def shutdown(self, timeout: float | None = None) -> None:
        """Send what is queued, for at most `timeout` (default: shutdown_timeout) seconds; then
        drop the rest and say so. Returns by the deadline whatever the collector does."""
        timeout = self.shutdown_timeout if timeout is None else timeout
        with self._lock:
            if self._closing:
                return
            self._closing = True
        self._wake.set()
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._log_drops_while_serving()
            return
        with self._lock:
            left = len(self._queue) + self._in_flight
            self._queue.clear()
            self._in_flight = 0
            self._abandoned = True
            self.dropped["shutdown"] += left
        if left:  # else the thread was just finishing
            logger.warning(
                "Trace export did not finish within %.1f s of shutdown (--otlp-shutdown-timeout): "
                "dropped %d spans not yet accepted by the collector",
                timeout,
                left,
            )
        self._log_drops_while_serving()
        # Stops the exporter's retries; a request already sent ends at its own timeout, on a
        # daemon thread that the interpreter's exit does not wait for.
        self._close_exporter()

    def dropped_counts(self) -> dict[str, int]:
        with self._lock:
            return dict(self.dropped)

    def _log_drops_while_serving(self) -> None:
        counts = self.dropped_counts()
        full, failed = counts["queue_full"], counts["export_failed"]
        if full or failed:
            logger.warning(
                "Trace export dropped %d spans while serving (%d: queue full, %d: export failed)",
                full + failed,
                full,
                failed,
            )

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        """Wait until everything queued now was sent (or dropped), at most timeout_millis."""
        deadline = time.monotonic() + timeout_millis / 1000
        self._wake.set()
        with self._lock:
            while self._queue or self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0 or self._abandoned or not self._thread.is_alive():
                    return False
                self._idle.wait(min(left, 0.1))
                self._wake.set()
        return True


class SpansDroppedCollector(Collector):
    """tessera:trace_spans_dropped_total{reason}: spans that never reached the collector."""

    def __init__(self, processor: BoundedSpanProcessor) -> None:
        self.processor = processor

    def collect(self) -> Iterator[Metric]:
        m = CounterMetricFamily(
            "tessera:trace_spans_dropped",
            "Trace spans dropped before the collector took them, by reason (queue_full: the "
            "export queue was full; export_failed: the collector failed or timed out; "
            "shutdown: still queued at --otlp-shutdown-timeout).",
            labels=["reason"],
        )
        counts = self.processor.dropped_counts()
        for reason in DROP_REASONS:
            m.add_metric([reason], counts[reason])
        yield m


__all__ = ["DROP_REASONS", "BoundedSpanProcessor", "SpansDroppedCollector"]
