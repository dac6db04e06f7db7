"""Hostile-but-fair bodies on a real server (loopback): each is a documented 4xx in the OpenAI
envelope, and none stalls the event loop for other clients."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

pytestmark = pytest.mark.slow

MODEL = "tiny"
BODY_LIMIT = 4 * 1024**2  # the default --max-body-size


@pytest.fixture(scope="module")
def server(start_server, tiny_llama_dir):
    return start_server(tiny_llama_dir, "--served-model-name", MODEL, "--auth", "none")


def _err(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    return r.json()["error"]


def test_stop_limits_are_400_naming_stop(server):
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    r = httpx.post(server.base_url + "/v1/completions", json={**body, "stop": ["x"] * 65})
    assert _err(r, 400)["param"] == "stop"
    r = httpx.post(server.base_url + "/v1/completions", json={**body, "stop": ["y" * 1025]})
    assert _err(r, 400)["param"] == "stop"
    r = httpx.post(server.base_url + "/v1/completions", json={**body, "stop": ["z" * 1024] * 64})
    assert r.status_code == 200, r.text


def _largest_chat_body() -> bytes:
    """As many empty messages as fit under the body limit: templating them is the slow part."""
    one = b'{"role":"user","content":""},'
    head, tail = b'{"model":"tiny","max_tokens":1,"messages":[', b'{"role":"user","content":""}]}'
    n = (BODY_LIMIT - len(head) - len(tail)) // len(one)
    body = head + one * n + tail
    assert len(body) <= BODY_LIMIT
    return body


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_health_answers_while_the_largest_chat_body_is_templated(server, path):
    body = _largest_chat_body()
    if path == "/tokenize":
        body = body.replace(b'"max_tokens":1,', b"")
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
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
    # The prompt does not fit the tiny model's context: a 400 after the template ran.
    assert status == (400 if path == "/v1/chat/completions" else 200), raw[:300]
    # Health checks sent after the body was complete were answered before the big request
    # finished (order, not time): with the template on the event loop there are none.
    assert answered >= 3, answered
