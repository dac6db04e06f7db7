"""OpenTelemetry spans, captured with the SDK's InMemorySpanExporter on the app in-process
(a real engine on a tiny model): one server span per HTTP request continuing the caller's
trace, an llm_request span per engine request with vLLM's gen_ai.* attribute names, and its
queue / prefill / decode children in order. Without the packages, the flag fails clearly;
with them, a real server exports to an OTLP/HTTP receiver on loopback."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

pytest.importorskip("opentelemetry.sdk")

from litestar.testing import TestClient  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import (  # noqa: E402
    InMemorySpanExporter,
)
from opentelemetry.trace import SpanKind  # noqa: E402

from api.server.app import create_app  # noqa: E402
from api.server.settings import Settings  # noqa: E402
from api.server.tracing import Tracing  # noqa: E402

TRACE_ID = "0af7651916cd43dd8448eb211c80319c"
PARENT = "b7ad6b7169203331"


def _wait_ready(client: TestClient) -> None:
    deadline = time.monotonic() + 120
    while client.get("/health").json()["status"] != "ok":
        assert time.monotonic() < deadline, "engine did not load"
        time.sleep(0.05)


def test_spans_of_one_completion(tiny_llama_dir) -> None:
    exporter = InMemorySpanExporter()
    settings = Settings(
        model=str(tiny_llama_dir), served_model_name="tiny", auth="none", dtype="float32",
        max_model_len=256, num_kv_blocks=256, num_threads=1,
    )  # fmt: skip
    app = create_app(settings, tracing=Tracing.with_exporter(exporter))
    with TestClient(app) as client:
        _wait_ready(client)
        exporter.clear()
        r = client.post(
            "/v1/completions",
            json={"model": "tiny", "prompt": ["Hello there", "Hi"], "max_tokens": 4,
                  "ignore_eos": True},
            headers={"X-Request-Id": "trace-me-1",
                     "traceparent": f"00-{TRACE_ID}-{PARENT}-01"},
        )  # fmt: skip
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-me-1"
        spans = exporter.get_finished_spans()

    server = [s for s in spans if s.kind == SpanKind.SERVER]
    assert len(server) == 1
    (srv,) = server
    assert srv.name == "POST /v1/completions"
    assert srv.attributes["gen_ai.request.id"] == "trace-me-1"
    assert srv.attributes["http.response.status_code"] == 200
    assert format(srv.context.trace_id, "032x") == TRACE_ID  # the caller's trace continues
    assert format(srv.parent.span_id, "016x") == PARENT

    llm = [s for s in spans if s.name == "llm_request"]
    assert len(llm) == 2  # one per prompt (engine request)
    for span in llm:
        a = span.attributes
        assert span.parent.span_id == srv.context.span_id
        assert a["gen_ai.request.id"] == "trace-me-1" and a["gen_ai.response.model"] == "tiny"
        assert a["gen_ai.usage.completion_tokens"] == 4 and a["gen_ai.usage.prompt_tokens"] > 0
        for name in ("gen_ai.latency.time_in_queue", "gen_ai.latency.time_to_first_token",
                     "gen_ai.latency.e2e", "gen_ai.latency.time_in_model_prefill",
                     "gen_ai.latency.time_in_model_decode"):  # fmt: skip
            assert a[name] >= 0, name
        assert a["gen_ai.latency.e2e"] >= a["gen_ai.latency.time_to_first_token"]
        children = sorted(
            (s for s in spans if s.parent is not None and s.parent.span_id == span.context.span_id),
            key=lambda s: s.start_time,
        )
        assert [c.name for c in children] == ["queue", "prefill", "decode"]
        assert children[0].start_time == span.start_time
        for before, after in zip(children, children[1:], strict=False):
            assert before.end_time <= after.start_time + 1  # ns rounding
        assert children[-1].end_time <= span.end_time + 1
        assert span.end_time <= srv.end_time


def test_missing_packages_is_a_clear_startup_error(tmp_path) -> None:
    # A python where `opentelemetry` cannot be imported: a blocker module on the path.
    blocker = tmp_path / "opentelemetry"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('blocked for the test')\n")
    code = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from api.cli.main import main;"
        "sys.exit(main(['serve', '--auth', 'none', '--otlp-traces-endpoint', 'http://127.0.0.1:9/v1/traces']))"
    )
    p = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 1
    assert "pip install 'tessera[otel]'" in p.stderr


def test_spans_reach_an_otlp_endpoint(start_server, tiny_llama_dir) -> None:
    """A real `tessera serve --otlp-traces-endpoint` posting OTLP/HTTP protobuf to a receiver
    on loopback: the request's server and llm_request spans arrive with its id."""
    import http.server
    import threading

    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
    )

    received: list[ExportTraceServiceRequest] = []

    class Receiver(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = self.rfile.read(int(self.headers["Content-Length"]))
            message = ExportTraceServiceRequest()
            message.ParseFromString(body)
            received.append(message)
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Receiver)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        endpoint = f"http://127.0.0.1:{httpd.server_address[1]}/v1/traces"
        server = start_server(
            tiny_llama_dir, "--auth", "none", "--served-model-name", "tiny",
            "--otlp-traces-endpoint", endpoint, env={"NO_PROXY": "127.0.0.1", "no_proxy": "127.0.0.1"},
        )  # fmt: skip
        import httpx

        r = httpx.post(
            server.base_url + "/v1/completions",
            json={"model": "tiny", "prompt": "Hi", "max_tokens": 2},
            headers={"X-Request-Id": "otlp-1"},
            timeout=60,
        )
        assert r.status_code == 200
        server.stop()  # shutdown flushes the batch processor

        def names() -> dict[str, dict]:
            found = {}
            for message in received:
                for rs in message.resource_spans:
                    for ss in rs.scope_spans:
                        for span in ss.spans:
                            attrs = {a.key: a.value for a in span.attributes}
                            if "gen_ai.request.id" in attrs:
                                found[span.name] = attrs
            return found

        spans = names()
        assert "POST /v1/completions" in spans and "llm_request" in spans, spans.keys()
        llm = spans["llm_request"]
        assert llm["gen_ai.request.id"].string_value == "otlp-1"
        assert llm["gen_ai.usage.completion_tokens"].int_value == 2
    finally:
        httpd.shutdown()
        thread.join(5)
