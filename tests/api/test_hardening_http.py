"""Hostile-but-fair bodies on a real server (loopback): each is a documented 4xx in the OpenAI
envelope, and none stalls the event loop for other clients."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.api.keys_http import ADMIN_TOKEN, MODEL, Admin, bearer, start_keys_server

pytestmark = pytest.mark.slow

BODY_LIMIT = 4 * 1024**2  # the default --max-body-size


@pytest.fixture(scope="module")
def server(start_server, tiny_llama_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hardening")
    url = f"sqlite+aiosqlite:///{tmp / 'tessera.db'}"
    server = start_keys_server(start_server, tiny_llama_dir, tmp, url)
    server.db_url = url
    return server


@pytest.fixture(scope="module")
def auth(server) -> dict[str, str]:
    _, key = Admin(server).create_key("hardening", rpm_limit=100_000, token_budget=10**12)
    return bearer(key)


def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_stop_limits_are_400_naming_stop(server, auth):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    c = httpx.Client(base_url=server.base_url, headers=auth, timeout=60)
    r = c.post("/v1/completions", json={**body, "stop": ["x"] * 65})
    assert _err(r, 400)["param"] == "stop"
    r = c.post("/v1/completions", json={**body, "stop": ["y" * 1025]})
    assert _err(r, 400)["param"] == "stop"
    r = c.post("/v1/completions", json={**body, "stop": ["z" * 1024] * 64})
    assert r.status_code == 200, r.text


def _largest_chat_body() -> bytes:
    """As many empty messages as fit under the body limit: templating them is the slow part."""
    one = b'{"role":"user","content":""},'
    head, tail = b'{"model":"tiny","max_tokens":1,"messages":[', b'{"role":"user","content":""}]}'
    n = (BODY_LIMIT - len(head) - len(tail)) // len(one)
    body = head + one * n + tail
    assert len(body) <= BODY_LIMIT
    return body


def test_health_answers_while_the_largest_chat_body_is_templated(server, auth):
    """/tokenize renders any conversation that fits the body limit (it has no context to
    fit: /v1/chat/completions refuses such a body before templating, below)."""
    path = "/tokenize"
    body = _largest_chat_body().replace(b'"max_tokens":1,', b"")
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"authorization: {auth['Authorization']}\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode()

    async def run() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as c:
            # All but the last byte, then health round trips until the server has read them:
            # from the last byte on, the server has only the parse and the template left.
            writer.write(head + body[:-1])
            await writer.drain()
            for _ in range(50):
                assert (await c.get("/health")).status_code == 200
            writer.write(body[-1:])
            await writer.drain()
            response = asyncio.ensure_future(reader.read())
            answered = 0
            while not response.done():
                r = await c.get("/health")
                assert r.status_code == 200
                answered += not response.done()
            writer.close()
            return answered, response.result()

    answered, raw = asyncio.run(run())
    status = int(raw.split(b" ", 2)[1])
    assert status == 200, raw[:300]
    # Health checks sent after the body was complete were answered before the big request
    # finished (order, not time): with the template on the event loop there are none.
    assert answered >= 3, answered


ROUTES = [
    ("POST", "/v1/chat/completions", False),
    ("POST", "/v1/completions", False),
    ("POST", "/v1/embeddings", False),
    ("POST", "/tokenize", False),
    ("POST", "/detokenize", False),
    ("POST", "/admin/v1/keys", True),
    ("PATCH", "/admin/v1/keys/none", True),
]
_ROUTE_IDS = [f"{m} {p}" for m, p, _ in ROUTES]


def _send(server, auth, method, path, admin, content: bytes, content_type: str | None):
    headers = {"authorization": f"Bearer {ADMIN_TOKEN}"} if admin else dict(auth)
    if content_type is not None:
        headers["content-type"] = content_type
    return httpx.request(
        method, server.base_url + path, content=content, headers=headers, timeout=60
    )


@pytest.mark.parametrize(("method", "path", "admin"), ROUTES, ids=_ROUTE_IDS)
@pytest.mark.parametrize(
    ("content", "content_type", "status", "says"),
    [
        (b"[" * 70 + b"]" * 70, "application/json", 400, "nested more than 64 levels"),
        (b'{"a":' * 5000 + b"1" + b"}" * 5000, "application/json", 400, "nested more than 64"),
        (
            b'{"model": "\\ud800"}'.replace(b"\\\\", b"\\"),
            "application/json",
            400,
            "lone surrogate escape `\\ud800`",
        ),
        (b"", "application/json", 400, "body is empty"),
        (b'{"model": "tiny", "pro', "application/json", 400, "not complete JSON"),
        (b'{"model": tiny}', "application/json", 400, "not valid JSON"),
        (b"\xff\xfe{}", "application/json", 400, "not valid"),
        (b'{"model": "tiny"}', "text/plain", 415, "got 'text/plain'"),
        (b'{"model": "tiny"}', None, 415, "no Content-Type header"),
        (b"model=tiny", "application/x-www-form-urlencoded", 415, "application/json"),
        (b'{"model": "tiny"}', "application/json; charset=utf-16", 415, "Content-Type"),
    ],
    ids=[
        "deep-arrays",
        "deep-objects",
        "lone-surrogate",
        "empty",
        "truncated",
        "malformed",
        "not-utf8",
        "text-plain",
        "no-content-type",
        "form",
        "utf16",
    ],
)
def test_bad_bodies_are_4xx_in_the_envelope(
    server, auth, method, path, admin, content, content_type, status, says
):
    r = _send(server, auth, method, path, admin, content, content_type)
    err = _err(r, status)
    assert says in err["message"], err
    assert err["type"] == "invalid_request_error"
    assert r.headers["content-type"].startswith("application/json")


def test_json_with_charset_and_the_openai_sdk_are_accepted(server, auth):
    import openai

    r = _send(
        server,
        auth,
        "POST",
        "/tokenize",
        False,
        b'{"prompt": "Hi"}',
        "application/json; charset=utf-8",
    )
    assert r.status_code == 200, r.text
    client = openai.OpenAI(
        base_url=server.base_url + "/v1", api_key=auth["Authorization"].split()[1]
    )
    out = client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
    assert out.choices[0].text is not None
    # Deep but within the limit is fine (here: a 400 for the field, not for the nesting).
    nested = b'{"model": "tiny", "prompt": "Hi", "metadata": ' + b"[" * 60 + b"]" * 60 + b"}"
    r = _send(server, auth, "POST", "/v1/completions", False, nested, "application/json")
    assert "nested" not in r.text


# --- the usage ledger: one row per ending, with the status the client got -----------------


def _rows(server, key_id: str, n: int) -> list:
    """The key's ledger rows, once `n` are there (the recorder writes in batches)."""
    import time

    from tests.api.usage.test_usage_http import ledger

    deadline = time.monotonic() + 30
    while True:
        rows = [r for r in ledger(server.db_url).values() if r.key_id == key_id]
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.3)


def _one_row(server, key_id: str):
    rows = _rows(server, key_id, 1)
    assert len(rows) == 1, [(r.status_code, r.finish_reason) for r in rows]
    return rows[0]


def _key(server, **limits) -> tuple[str, dict[str, str]]:
    key_id, key = Admin(server).create_key(None, token_budget=10**12, **limits)
    return key_id, bearer(key)


CHAT = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize(
    ("extra", "status", "param"),
    [
        ({"temperature": 5}, 400, "temperature"),  # refused by the API, before the engine
        ({"stop_token_ids": [10**6]}, 400, "stop_token_ids"),  # refused by the engine
        ({"logit_bias": {"999999": 5}}, 400, "logit_bias"),  # refused by the engine
        ({"stop": ["x"] * 65}, 400, "stop"),
        ({"model": "nope"}, 404, "model"),
    ],
    ids=["api-400", "engine-400-stop-token-ids", "engine-400-logit-bias", "stop-400", "404"],
)
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_ledger_row_of_a_refused_request(server, route, extra, status, param):
    key_id, headers = _key(server)
    body = {"model": MODEL, "max_tokens": 3, **extra}
    body.update({"prompt": "Hi"} if route == "/v1/completions" else {"messages": CHAT})
    r = httpx.post(server.base_url + route, json=body, headers=headers, timeout=60)
    assert _err(r, status)["param"] == param
    row = _one_row(server, key_id)
    assert (row.status_code, row.finish_reason) == (status, None)
    assert (row.prompt_tokens, row.completion_tokens) == (0, 0)


def test_ledger_row_of_a_415(server):
    key_id, headers = _key(server)
    r = httpx.post(
        server.base_url + "/v1/completions",
        content=b'{"model": "tiny", "prompt": "Hi"}',
        headers={**headers, "content-type": "text/plain"},
    )
    _err(r, 415)
    row = _one_row(server, key_id)
    assert (row.status_code, row.finish_reason, row.model) == (415, None, "")


def test_ledger_rows_of_completed_and_429(server):
    key_id, headers = _key(server, rpm_limit=1)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
    r = httpx.post(server.base_url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    r2 = httpx.post(server.base_url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert r2.status_code == 429, r2.text
    rows = {r.status_code: r for r in _rows(server, key_id, 2)}
    assert set(rows) == {200, 429}
    assert rows[200].finish_reason == "length" and rows[200].completion_tokens == 3
    assert rows[200].request_id == r.json()["id"]
    assert (rows[429].finish_reason, rows[429].completion_tokens, rows[429].model) == (
        None,
        0,
        MODEL,
    )


def test_ledger_row_of_a_disconnect(server):
    key_id, headers = _key(server)
    body = {"model": MODEL, "prompt": "Bye", "max_tokens": 400, "stream": True}

    async def leave() -> None:
        async with (
            httpx.AsyncClient(base_url=server.base_url, timeout=60) as c,
            c.stream(
                "POST", "/v1/completions", json={**body, "ignore_eos": True}, headers=headers
            ) as r,
        ):
            async for line in r.aiter_lines():
                if '"text"' in line:
                    return

    asyncio.run(leave())
    row = _one_row(server, key_id)
    assert (row.status_code, row.finish_reason) == (499, "abort")
    assert 1 <= row.completion_tokens < 400


def test_ledger_row_of_a_503_at_admission(start_server, tiny_llama_dir, tmp_path):
    """A server whose waiting queue takes nothing: every request is refused with 503."""
    url = f"sqlite+aiosqlite:///{tmp_path / 'tessera.db'}"
    full = start_keys_server(
        start_server, tiny_llama_dir, tmp_path, url, "--max-num-queued-requests", "0"
    )
    full.db_url = url
    key_id, headers = _key(full)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3}
    r = httpx.post(full.base_url + "/v1/completions", json=body, headers=headers, timeout=60)
    assert _err(r, 503)["type"] == "service_unavailable"
    row = _one_row(full, key_id)
    assert (row.status_code, row.finish_reason) == (503, None)
    full.stop()
