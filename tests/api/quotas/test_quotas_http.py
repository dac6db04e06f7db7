"""Quotas over HTTP, on real `tessera serve` processes with a SQLite file and with Postgres:
the token budget under 40 concurrent requests, a disconnected stream's reservation coming
back, and the rpm / tpm / parallel limits at exactly their bounds with their headers.

Every request here uses ignore_eos, so it produces exactly max_tokens tokens: the tokens a
request uses are then known in advance (prompt + max_tokens) and equal its reservation.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.keys_http import (
    BACKENDS,
    MODEL,
    Admin,
    bearer,
    complete,
    fresh_database,
    prompt_tokens,
    start_keys_server,
)

pytestmark = pytest.mark.slow

PROMPT = "Hello"
MAX_TOKENS = 8


@pytest.fixture(scope="module", params=BACKENDS)
def server(request, start_server, tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(f"quota-{request.param}")
    with fresh_database(request.param, tmp) as url:
        yield start_keys_server(start_server, tiny_llama_dir, tmp, url)


@pytest.fixture(scope="module")
def cost(server) -> int:
    """Tokens one test request reserves, and uses: prompt + max_tokens."""
    _, key = Admin(server).create_key()
    return prompt_tokens(server, key, PROMPT) + MAX_TOKENS


def scrape(server) -> str:
    return httpx.get(server.base_url + "/metrics", timeout=10).text


def rejections(text: str, reason: str) -> float:
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "tessera:quota_rejections_total" and s.labels == {"reason": reason}:
                return s.value
    return 0.0  # a labelled series appears on its first observation


async def burst(server, key: str, n: int, **body) -> list[httpx.Response]:
    payload = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as c:
        return await asyncio.gather(
            *(
                c.post("/v1/completions", json={**payload, **body}, headers=bearer(key))
                for _ in range(n)
            )
        )


def test_budget_edge_under_40_concurrent_requests(server, cost):
    admin = Admin(server)
    budget = 10 * cost + cost // 2  # room for 10 requests, not 11
    key_id, key = admin.create_key(token_budget=budget)
    before = scrape(server)

    responses = asyncio.run(burst(server, key, 40))

    ok = [r for r in responses if r.status_code == 200]
    refused = [r for r in responses if r.status_code != 200]
    assert len(ok) == 10, [r.status_code for r in responses]
    for r in refused:
        assert r.status_code == 429, r.text
        assert r.json()["error"]["type"] == "insufficient_quota"
        assert r.json()["error"]["code"] == "insufficient_quota"
        assert r.headers["x-should-retry"] == "false"
    assert all(r.json()["usage"]["total_tokens"] == cost for r in ok)
    # Reservations and use agree: the budget holds exactly what the 10 used.
    assert admin.key(key_id)["budget_used"] == 10 * cost <= budget
    usage = admin.usage(key_id)
    assert (usage["requests"], usage["errors"]) == (40, 30)  # the 429s have rows too
    assert usage["prompt_tokens"] + usage["completion_tokens"] == 10 * cost
    assert rejections(scrape(server), "budget") - rejections(before, "budget") == 30


async def multi_key_burst(server, keys: list[str], n: int) -> list[httpx.Response]:
    payload = {"model": MODEL, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    limits = httpx.Limits(max_connections=n)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120, limits=limits) as c:
        return await asyncio.gather(
            *(
                c.post("/v1/completions", json=payload, headers=bearer(keys[i % len(keys)]))
                for i in range(n)
            )
        )


def test_tenant_budget_edge_under_40_concurrent_requests_from_4_keys(server, cost):
    admin = Admin(server)
    budget = 10 * cost + cost // 2  # the tenant has room for 10 requests, not 11
    r = admin.request("POST", "/tenants", json={"name": f"edge-{server.port}",
                                                "token_budget": budget})  # fmt: skip
    assert r.status_code == 201, r.text
    tenant_id = r.json()["id"]
    # Each key alone could take all 40: only the tenant's budget stops them.
    keys = [admin.create_key(tenant_id=tenant_id, token_budget=40 * cost) for _ in range(4)]

    responses = asyncio.run(multi_key_burst(server, [k for _, k in keys], 40))

    ok = [r for r in responses if r.status_code == 200]
    assert len(ok) == 10, [r.status_code for r in responses]
    for r in responses:
        if r.status_code != 200:
            assert r.status_code == 429 and r.json()["error"]["code"] == "insufficient_quota"
            assert "tenant's token budget" in r.json()["error"]["message"]
    tenant = admin.request("GET", f"/tenants/{tenant_id}").json()
    assert tenant["budget_used"] == 10 * cost <= budget
    assert sum(admin.key(key_id)["budget_used"] for key_id, _ in keys) == 10 * cost


async def _read_two_chunks_then_leave(server, key: str) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 400, "stream": True}
    body["ignore_eos"] = True
    async with (
        httpx.AsyncClient(base_url=server.base_url, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body, headers=bearer(key)) as r,
    ):
        assert r.status_code == 200
        chunks = 0
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"text"' in line:
                chunks += 1
                if chunks == 2:
                    return  # leaving the block drops the connection mid-stream


def test_disconnected_stream_returns_its_reservation(server, cost):
    admin = Admin(server)
    prompt = cost - MAX_TOKENS
    key_id, key = admin.create_key(token_budget=prompt + 400 + 5)  # room for one such stream
    asyncio.run(_read_two_chunks_then_leave(server, key))
    server.wait_idle()

    usage = admin.usage(key_id)
    assert usage["requests"] == 1 and usage["prompt_tokens"] == prompt
    used = usage["prompt_tokens"] + usage["completion_tokens"]
    assert 2 <= usage["completion_tokens"] < 400  # cut short, not run to the end
    assert admin.key(key_id)["budget_used"] == used
    # The returned tokens can be spent again.
    assert complete(server, key, max_tokens=400 - usage["completion_tokens"]).status_code == 200


def test_rpm_limit_at_its_bound(server):
    _, key = Admin(server).create_key(rpm_limit=3)
    for remaining in (2, 1, 0):
        r = complete(server, key)
        assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-limit-requests"] == "3"
        assert r.headers["x-ratelimit-remaining-requests"] == str(remaining)
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
    r = complete(server, key)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert r.json()["error"]["type"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert r.headers["x-ratelimit-remaining-requests"] == "0"


def test_tpm_limit_at_its_bound(server, cost):
    _, key = Admin(server).create_key(tpm_limit=3 * cost)
    for i in range(3):
        r = complete(server, key, prompt=PROMPT, max_tokens=MAX_TOKENS)
        assert r.status_code == 200, r.text
        assert r.headers["x-ratelimit-limit-tokens"] == str(3 * cost)
        assert r.headers["x-ratelimit-remaining-tokens"] == str((2 - i) * cost)
    r = complete(server, key, prompt=PROMPT, max_tokens=MAX_TOKENS)
    assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
    assert 1 <= int(r.headers["retry-after"]) <= 60
    assert r.headers["x-ratelimit-remaining-tokens"] == "0"
    # A request that could never fit says so.
    r = complete(server, key, prompt=PROMPT, max_tokens=3 * cost)
    assert r.status_code == 429 and "Request too large" in r.json()["error"]["message"]


def test_parallel_limit_at_its_bound(server):
    """Two streams hold both slots; a third request is refused; once they end — the last
    byte is sent only after the release — the next request is admitted at once."""
    _, key = Admin(server).create_key(max_parallel=2)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 300, "stream": True}
    body["ignore_eos"] = True

    async def scenario() -> tuple[int, str, list[int]]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as c:
            streams = [
                c.stream("POST", "/v1/completions", json=body, headers=bearer(key))
                for _ in range(2)
            ]
            opened = [await s.__aenter__() for s in streams]
            lines = [r.aiter_lines() for r in opened]
            for it in lines:  # both are admitted and generating
                while '"text"' not in await anext(it):
                    pass
            third = await c.post(
                "/v1/completions",
                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 2},
                headers=bearer(key),
            )
            for it in lines:
                async for _ in it:
                    pass
            for s in streams:
                await s.__aexit__(None, None, None)
            after = [
                (await c.post("/v1/completions", json={**body, "stream": False}, headers=h))
                for h in (bearer(key),)
            ]
            return third.status_code, third.text, [r.status_code for r in after]

    status, text, after = asyncio.run(scenario())
    assert status == 429, text
    assert "parallel" in json.loads(text)["error"]["message"]
    assert after == [200]


def test_streaming_responses_carry_the_headers(server):
    _, key = Admin(server).create_key(rpm_limit=100, tpm_limit=100_000)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    with httpx.stream(
        "POST", server.base_url + "/v1/completions", json=body, headers=bearer(key), timeout=60
    ) as r:
        assert r.status_code == 200
        assert r.headers["x-ratelimit-limit-requests"] == "100"
        assert r.headers["x-ratelimit-remaining-requests"] == "99"
        assert r.headers["x-ratelimit-limit-tokens"] == "100000"
        assert r.headers["content-type"].startswith("text/event-stream")
        assert list(r.iter_lines())[-2:] == ["data: [DONE]", ""]
