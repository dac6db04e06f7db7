"""Prometheus metrics: known traffic through a real AsyncEngine (tiny Llama) gives the exact
counter and histogram values, under vLLM's exposed names; HTTP requests are counted by route
template; /metrics serves the text format."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
from litestar import Litestar, get
from litestar.exceptions import NotAuthorizedException
from litestar.params import FromPath
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from api.server.metrics import CONTENT_TYPE, Metrics, MetricsPlugin, buckets_1_2_5
from engine import CacheConfig, EngineConfig, ModelConfig, SamplingParams, SchedulerConfig
from engine.async_engine import AsyncEngine
from engine.protocol import EngineRequest

MODEL = "tiny"


def value(text: str, name: str, **labels: str) -> float:
    """The sample `name` with exactly these labels (besides model_name) in the exposition."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            want = {"model_name": MODEL, **labels} if name.startswith("vllm:") else labels
            if s.name == name and s.labels == want:
                return s.value
    raise AssertionError(f"no sample {name}{labels} in:\n{text}")


def has(text: str, name: str) -> bool:
    return any(s.name == name for f in text_string_to_metric_families(text) for s in f.samples)


@pytest.fixture
async def engine(tiny_llama_dir):
    torch.set_num_threads(1)
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256),
        cache=CacheConfig(num_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=256),
        served_model_name=MODEL,
    )
    engine = await AsyncEngine.create(config)
    yield engine
    await engine.shutdown()


async def run_request(engine, metrics: Metrics, rid: str, ids, params, key=None, stop_after=None):
    """What the HTTP request path does: start, observe every output, abort if cut short."""
    metrics.request_started(rid, key_name=key)
    seen = 0
    async for out in engine.generate(EngineRequest(rid, ids, params)):
        metrics.observe(rid, out)
        seen += 1
        if stop_after is not None and seen >= stop_after:
            break  # the client went away: the engine aborts on aclose
    metrics.request_aborted(rid)  # a no-op when the engine finished it


async def test_known_traffic_gives_exact_counts(engine):
    metrics = Metrics(MODEL, stats=engine.stats, key_label="name")  # per-key series: opt in
    ids = engine.tokenizer.encode("Hello world")
    assert len(ids) < 16  # no full block, so no prefix-cache hit: every prompt token computed
    params = SamplingParams(max_tokens=7, temperature=0, ignore_eos=True)
    before = metrics.render().decode()
    assert value(before, "vllm:generation_tokens_total") == 0

    await asyncio.gather(
        *(run_request(engine, metrics, f"r{i}", ids, params, key="team-a") for i in range(5))
    )
    text = metrics.render().decode()
    assert value(text, "vllm:generation_tokens_total") == 35
    assert value(text, "vllm:prompt_tokens_total") == 5 * len(ids)
    assert value(text, "vllm:request_success_total", finished_reason="length") == 5
    assert value(text, "vllm:time_to_first_token_seconds_count") == 5
    assert value(text, "vllm:inter_token_latency_seconds_count") == 5 * 6
    assert value(text, "vllm:e2e_request_latency_seconds_count") == 5
    assert value(text, "vllm:request_queue_time_seconds_count") == 5
    assert value(text, "vllm:request_generation_tokens_count") == 5
    assert value(text, "vllm:request_generation_tokens_sum") == 35
    assert value(text, "vllm:request_prompt_tokens_sum") == 5 * len(ids)
    # Every request's 7 tokens fall in the le=10 bucket and none below it.
    assert value(text, "vllm:request_generation_tokens_bucket", le="5.0") == 0
    assert value(text, "vllm:request_generation_tokens_bucket", le="10.0") == 5
    assert value(text, "tessera:requests_total", key_name="team-a") == 5
    assert value(text, "tessera:tokens_total", key_name="team-a", kind="generation") == 35
    assert value(text, "tessera:tokens_total", key_name="team-a", kind="prompt") == 5 * len(ids)
    # Idle again: the gauges read the engine at scrape time.
    assert value(text, "vllm:num_requests_running") == 0
    assert value(text, "vllm:num_requests_waiting") == 0
    assert value(text, "vllm:kv_cache_usage_perc") == 0
    assert metrics.num_live == 0


async def test_aborted_stream_and_live_gauges(engine):
    metrics = Metrics(MODEL, stats=engine.stats)
    ids = engine.tokenizer.encode("The quick brown fox")
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    metrics.request_started("live", key_name="k")
    gen = engine.generate(EngineRequest("live", ids, long))
    metrics.observe("live", await anext(gen))
    metrics.observe("live", await anext(gen))
    text = metrics.render().decode()
    assert value(text, "vllm:num_requests_running") == 1
    assert value(text, "vllm:kv_cache_usage_perc") == engine.stats().kv_cache_usage > 0
    assert metrics.key_name("live") == "k"
    await gen.aclose()
    metrics.request_aborted("live")
    # A cut-short stream through the request path's helper counts the same way.
    await run_request(engine, metrics, "cut", ids, long, stop_after=2)
    text = metrics.render().decode()
    assert value(text, "vllm:request_success_total", finished_reason="abort") == 2
    reasons = {
        s.labels["finished_reason"]
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "vllm:request_success_total"
    }
    assert reasons == {"abort"}  # nothing else was counted
    assert value(text, "vllm:time_to_first_token_seconds_count") == 2
    assert metrics.num_live == 0


async def test_prefix_cache_and_stop_reason(engine):
    metrics = Metrics(MODEL, stats=engine.stats)
    ids = engine.tokenizer.encode("Tessera serves language models with a paged key value cache.")
    ids = (ids * 4)[:40]  # two full blocks
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    await run_request(engine, metrics, "a", ids, params)
    await run_request(engine, metrics, "b", ids, params)
    stats = engine.stats()
    text = metrics.render().decode()
    assert stats.prefix_cache_hits >= 32  # the second request reused both full blocks
    assert value(text, "vllm:prefix_cache_hits_total") == stats.prefix_cache_hits
    assert value(text, "vllm:prefix_cache_queries_total") == stats.prefix_cache_queries
    assert value(text, "vllm:num_preemptions_total") == stats.num_preemptions == 0
    # Prefix-cache hits are not computed: the prompt counter counts only computed tokens.
    assert value(text, "vllm:prompt_tokens_total") == 2 * len(ids) - stats.prefix_cache_hits
    # A stop token ends a request with finished_reason="stop".
    first = engine.tokenizer.encode("Hello")
    probe = []
    async for out in engine.generate(
        EngineRequest("probe", first, SamplingParams(max_tokens=2, temperature=0))
    ):
        probe = out.outputs[0].token_ids
    stop = SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[probe[1]])
    await run_request(engine, metrics, "s", first, stop)
    text = metrics.render().decode()
    assert value(text, "vllm:request_success_total", finished_reason="stop") == 1


def test_engine_series_absent_while_loading_and_bad_input():
    metrics = Metrics(MODEL)
    text = metrics.render().decode()
    assert not has(text, "vllm:num_requests_waiting")
    assert has(text, "process_cpu_seconds_total")  # the process collectors are on by default
    metrics.rejected("quota", "rpm")
    metrics.rejected("quota", "rpm")
    metrics.rejected("admission", "queue_full")
    text = metrics.render().decode()
    assert value(text, "tessera:quota_rejections_total", reason="rpm") == 2
    assert value(text, "tessera:admission_rejections_total", reason="queue_full") == 1
    with pytest.raises(ValueError, match="kind must be one of quota, admission"):
        metrics.rejected("bogus", "x")
    with pytest.raises(ValueError, match="finished_reason must be one of"):
        metrics.request_finished("x", "done", 1, 1)
    # Two instances never collide (nothing global).
    assert Metrics(MODEL).render()
    assert buckets_1_2_5(100) == [1, 2, 5, 10, 20, 50, 100]


def test_http_requests_counted_by_route_template():
    metrics = Metrics(MODEL)

    @get("/items/{item_id:int}", sync_to_thread=False)
    def item(item_id: FromPath[int]) -> dict:
        return {"id": item_id}

    @get("/secret", sync_to_thread=False)
    def secret() -> None:
        raise NotAuthorizedException("no")

    app = Litestar([item, secret], plugins=[MetricsPlugin(metrics)])
    with TestClient(app) as client:
        for i in (1, 2, 3):
            assert client.get(f"/items/{i}").status_code == 200
        assert client.get("/secret").status_code == 401
        r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    assert r.headers["content-type"] == CONTENT_TYPE + "; charset=utf-8"
    text = r.text
    route = {"route": "/items/{item_id}", "method": "GET"}
    assert value(text, "tessera:http_requests_total", **route, status="200") == 3
    assert value(text, "tessera:http_requests_total", route="/secret", method="GET", status="401")
    assert "/items/1" not in text  # raw paths never become labels


# -- through a real `tessera serve` process -----------------------------------------------------


@pytest.fixture(scope="module")
def open_server(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir, "--served-model-name", MODEL, "--auth", "none")
    if httpx.get(server.base_url + "/metrics", timeout=10).status_code == 404:
        pytest.skip("/metrics is not mounted by create_app yet")
    return server


def scrape(server) -> str:
    r = httpx.get(server.base_url + "/metrics", timeout=10)
    assert r.status_code == 200
    return r.text


def delta(before: str, after: str, name: str, **labels: str) -> float:
    def get(text: str) -> float:
        try:
            return value(text, name, **labels)
        except AssertionError:
            return 0.0  # a labelled series appears on its first observation

    return get(after) - get(before)


@pytest.mark.slow
def test_http_traffic_gives_exact_counts(open_server):
    server = open_server
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
    before = scrape(server)
    for _ in range(5):
        r = client.completions.create(
            model=MODEL,
            prompt="Hello",
            max_tokens=7,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert r.usage.completion_tokens == 7
    server.wait_idle()
    after = scrape(server)
    assert delta(before, after, "vllm:generation_tokens_total") == 35
    assert delta(before, after, "vllm:time_to_first_token_seconds_count") == 5
    assert delta(before, after, "vllm:inter_token_latency_seconds_count") == 30
    assert delta(before, after, "vllm:e2e_request_latency_seconds_count") == 5
    assert delta(before, after, "vllm:request_generation_tokens_sum") == 35
    assert delta(before, after, "vllm:request_success_total", finished_reason="length") == 5
    route = {"route": "/v1/completions", "method": "POST", "status": "200"}
    assert delta(before, after, "tessera:http_requests_total", **route) == 5
    assert value(after, "vllm:num_requests_running") == 0

    # A stream the client drops after two chunks is counted as aborted.
    stream = client.completions.create(
        model=MODEL, prompt="Hello", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    for i, _ in enumerate(stream):
        if i == 1:
            break
    stream.close()
    stats = server.wait_idle()
    assert stats["num_running"] == 0
    final = scrape(server)
    assert delta(after, final, "vllm:request_success_total", finished_reason="abort") == 1
    assert delta(after, final, "vllm:request_success_total", finished_reason="length") == 0


def test_per_key_series_labelled_by_id_with_metrics_key_label_id():
    """--metrics-key-label id: the key's id labels the series, never its name; the console
    still sees the name of a request in flight."""
    by_id = Metrics(MODEL, key_label="id")
    by_id.request_started("r1", key_name="alice@example.com", key_id="key_123")
    assert by_id.key_name("r1") == "alice@example.com"
    by_id.request_finished("r1", "stop", prompt_tokens=3, generation_tokens=2)
    text = by_id.render().decode()
    assert value(text, "tessera:requests_total", key_id="key_123") == 1
    assert value(text, "tessera:tokens_total", key_id="key_123", kind="generation") == 2
    assert "alice@example.com" not in text and 'key_name="' not in text
    by_name = Metrics(MODEL, key_label="name")
    by_name.request_started("r1", key_name="alice", key_id="key_123")
    by_name.request_finished("r1", "stop", prompt_tokens=3, generation_tokens=2)
    assert value(by_name.render().decode(), "tessera:requests_total", key_name="alice") == 1
    with pytest.raises(ValueError, match="key_label"):
        Metrics(MODEL, key_label="secret")


def test_by_default_no_series_names_a_key_or_a_tenant():
    """--metrics-key-label none and --metrics-tenant-label none (the defaults): one series for
    all keys, no per-tenant families; `id` turns the tenant families on."""
    from engine.stats import EngineStats

    stats = EngineStats(loop_alive=True, tenants={"tenant-123": (40, 16, 5)})
    metrics = Metrics(MODEL, stats=lambda: stats)
    for rid in ("r1", "r2"):
        metrics.request_started(rid, key_name="alice@example.com", key_id="key_123")
        metrics.request_finished(rid, "stop", prompt_tokens=3, generation_tokens=2)
    assert metrics.key_name("r1") is None  # finished; a live one still shows in the console
    text = metrics.render().decode()
    assert value(text, "tessera:requests_total") == 2
    assert value(text, "tessera:tokens_total", kind="generation") == 4
    assert value(text, "tessera:tokens_total", kind="prompt") == 6
    assert "key_name=" not in text and "key_id=" not in text and "alice" not in text
    assert "_by_tenant" not in text and "tenant-123" not in text
    by_tenant = Metrics(MODEL, stats=lambda: stats, tenant_label="id").render().decode()
    labels = {"model_name": MODEL, "tenant": "tenant-123"}
    assert value(by_tenant, "tessera:prefix_cache_hits_by_tenant_total", **labels) == 16
    assert value(by_tenant, "tessera:generation_tokens_by_tenant_total", **labels) == 5
    with pytest.raises(ValueError, match="tenant_label"):
        Metrics(MODEL, tenant_label="name")


def test_spec_decode_counters():
    """vLLM's speculative-decoding counters, present only while it is on."""
    from engine.stats import EngineStats

    stats = EngineStats(
        loop_alive=True,
        spec_decode_num_drafts=7,
        spec_decode_num_draft_tokens=20,
        spec_decode_num_accepted_tokens=9,
        spec_decode_accepted_per_pos=(6, 2, 1),
        spec_decode_controller_draft_steps=5,
        spec_decode_controller_plain_steps=11,
    )
    text = Metrics(MODEL, stats=lambda: stats).render().decode()
    assert value(text, "vllm:spec_decode_num_drafts_total", model_name=MODEL) == 7
    for decision, n in (("draft", 5), ("plain", 11)):
        name = "tessera:spec_decode_controller_steps_total"
        assert value(text, name, model_name=MODEL, decision=decision) == n
    assert value(text, "vllm:spec_decode_num_draft_tokens_total", model_name=MODEL) == 20
    assert value(text, "vllm:spec_decode_num_accepted_tokens_total", model_name=MODEL) == 9
    for pos, n in enumerate((6, 2, 1)):
        assert (
            value(
                text,
                "vllm:spec_decode_num_accepted_tokens_per_pos_total",
                model_name=MODEL,
                position=str(pos),
            )
            == n
        )
    off = Metrics(MODEL, stats=lambda: EngineStats(loop_alive=True)).render().decode()
    assert "spec_decode" not in off
