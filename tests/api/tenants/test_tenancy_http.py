"""Tenancy over HTTP on a real server (keys mode, SQLite): each key's prefix cache is its own
(salted per tenant), prefix hits are reported per tenant in /metrics, and a request past
--request-timeout is stopped by the engine: 504 `request_timeout` (in-band once streaming),
its blocks back in the pool, its usage row written with the status and finish reason."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.api.keys_http import (
    ADMIN_TOKEN,
    MODEL,
    Admin,
    bearer,
    complete,
    start_keys_server,
)
from tests.api.usage.test_usage_http import ledger

pytestmark = pytest.mark.slow

# ~100 tokens: several full 16-token blocks to hit.
PROMPT = " ".join(f"word{i}" for i in range(40))


def _cached(server, key: str) -> int:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "ignore_eos": True}
    r = httpx.post(f"{server.base_url}/v1/completions", json=body, headers=bearer(key), timeout=60)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["prompt_tokens"] > 64
    return usage["prompt_tokens_details"]["cached_tokens"]


def _metric(text: str, name: str, tenant: str) -> float:
    m = re.search(
        rf'^{re.escape(name)}\{{model_name="{MODEL}",tenant="{tenant}"\}} (\S+)$', text, re.M
    )
    assert m, f"{name} for {tenant} not in /metrics"
    return float(m.group(1))


def test_tenants_never_hit_each_others_prefix_cache(start_server, tiny_llama_dir, tmp_path):
    url = f"sqlite+aiosqlite:///{tmp_path / 'tessera.db'}"
    # The per-tenant series are opt-in (off by default: /metrics is often open).
    server = start_keys_server(
        start_server, tiny_llama_dir, tmp_path, url, "--metrics-tenant-label", "id"
    )
    admin = Admin(server)
    a_id, a = admin.create_key("tenant-a")
    b_id, b = admin.create_key("tenant-b")
    r = complete(server, a, priority=5000)  # vLLM's extra, range-checked
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    assert complete(server, a, priority=3).status_code == 200
    assert _cached(server, a) == 0
    hits = _cached(server, a)  # the same tenant: its own blocks
    assert hits >= 64
    assert _cached(server, b) == 0  # the other tenant: nothing of a's, same prompt
    assert _cached(server, b) == hits  # ...and its own blocks from then on
    text = httpx.get(f"{server.base_url}/metrics", timeout=30).text
    for tenant, generated in ((a_id, 4 + 2 * 2), (b_id, 2 * 2)):
        assert _metric(text, "tessera:prefix_cache_hits_by_tenant_total", tenant) == hits
        queries = _metric(text, "tessera:prefix_cache_queries_by_tenant_total", tenant)
        assert queries > 2 * hits  # two prompts looked up, the first missed
        assert _metric(text, "tessera:generation_tokens_by_tenant_total", tenant) == generated


def _engine(server) -> dict:
    r = httpx.get(f"{server.base_url}/admin/v1/engine", headers=bearer(ADMIN_TOKEN), timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_request_past_the_timeout_is_stopped_freed_and_recorded(
    start_server, tiny_llama_dir, tmp_path
):
    url = f"sqlite+aiosqlite:///{tmp_path / 'tessera.db'}"
    # 480 tokens take the tiny model far longer than 0.1 s on any machine.
    server = start_keys_server(
        start_server, tiny_llama_dir, tmp_path, url, "--request-timeout", "0.1"
    )
    admin = Admin(server)
    key_id, key = admin.create_key("deadline")
    body = {"model": MODEL, "prompt": "Long", "max_tokens": 480, "ignore_eos": True}
    client = httpx.Client(base_url=server.base_url, headers=bearer(key), timeout=60)

    r = client.post("/v1/completions", json=body)
    assert r.status_code == 504, r.text
    error = r.json()["error"]
    assert (error["type"], error["code"]) == ("timeout", "request_timeout")

    with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as s:
        lines = [line for line in s.iter_lines() if line]
    if s.status_code == 200:  # the stream started before the deadline: the error in-band
        events = [line[6:] for line in lines if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["error"]["code"] == "request_timeout"
    else:  # past the deadline before its first token (a slow machine): no stream at all
        assert s.status_code == 504 and "request_timeout" in lines[0]
    server.wait_idle()
    state = _engine(server)
    assert (state["num_running"], state["num_waiting"], state["kv_cache_usage"]) == (0, 0, 0.0)

    # A short one still completes: the timeout stops only what runs past it.
    ok = client.post("/v1/completions", json={**body, "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    client.close()
    admin.usage(key_id)  # waits for the ledger's batch writes
    rows = ledger(url)
    timed_out = [r for r in rows.values() if r.status_code == 504]
    assert len(timed_out) == 2
    for row in timed_out:
        assert row.finish_reason == "timeout" and row.key_id == key_id
        assert row.prompt_tokens > 0 and row.completion_tokens < 480
    assert sorted(r.status_code for r in rows.values()) == [200, 504, 504]
