"""The usage ledger over HTTP: one row per request — completed, disconnected, or aborted when
the server shut down — with the tokens the client was told, and none lost on a clean
shutdown (SIGTERM, then the database is read after the process exited).
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading

import httpx
import pytest
from sqlalchemy import select

from api.db.models import UsageRow
from api.db.session import Database
from tests.api.conftest import stream_in_thread
from tests.api.keys_http import BACKENDS, MODEL, Admin, bearer, fresh_database, start_keys_server

pytestmark = pytest.mark.slow


def ledger(url: str) -> dict[str, UsageRow]:
    async def read() -> dict[str, UsageRow]:
        db = Database.from_url(url)
        try:
            async with db.session() as s:
                return {r.request_id: r for r in (await s.scalars(select(UsageRow))).all()}
        finally:
            await db.dispose()

    return asyncio.run(read())


def _stream_in_thread(server, key: str, body: dict, events: list, started: threading.Event):
    return stream_in_thread(server, body, events, started, headers=bearer(key))


async def _leave_after_two_chunks(server, key: str) -> str:
    body = {"model": MODEL, "prompt": "Bye", "max_tokens": 400, "stream": True}
    body["ignore_eos"] = True
    async with (
        httpx.AsyncClient(base_url=server.base_url, timeout=60) as c,
        c.stream("POST", "/v1/completions", json=body, headers=bearer(key)) as r,
    ):
        chunks = 0
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"text"' in line:
                chunks += 1
                if chunks == 2:
                    return json.loads(line[len("data: ") :])["id"]
    raise AssertionError("the stream ended early")


async def _burst(server, key: str, n: int) -> list[dict]:
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
        rs = await asyncio.gather(
            *(c.post("/v1/completions", json=body, headers=bearer(key)) for _ in range(n))
        )
    assert all(r.status_code == 200 for r in rs)
    return [r.json() for r in rs]


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_request_has_a_row_and_none_is_lost_on_shutdown(
    backend, start_server, tiny_llama_dir, tmp_path
):
    with fresh_database(backend, tmp_path) as url:
        server = start_keys_server(
            start_server, tiny_llama_dir, tmp_path, url, "--shutdown-timeout", "0"
        )
        admin = Admin(server)
        key_id, key = admin.create_key("ledger", rpm_limit=1000, token_budget=10**9)
        client = httpx.Client(base_url=server.base_url, headers=bearer(key), timeout=60)
        expected: dict[
            str, tuple[int, int, str, int]
        ] = {}  # id -> prompt, completion, reason, status

        def finished(body: dict, status: int = 200) -> None:
            u = body["usage"]
            reasons = {c["finish_reason"] for c in body["choices"]}
            reason = "length" if "length" in reasons else "stop"
            expected[body["id"]] = (u["prompt_tokens"], u["completion_tokens"], reason, status)

        # Completed: one prompt, n=2, two prompts in one request, and a chat.
        for extra in ({}, {"n": 2}, {"prompt": ["Hello", "Hello world"]}):
            body = {"model": MODEL, "prompt": "Hello", "max_tokens": 5, "ignore_eos": True}
            r = client.post("/v1/completions", json={**body, **extra})
            assert r.status_code == 200, r.text
            finished(r.json())
        r = client.post(
            "/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3},
        )
        finished(r.json())

        # Disconnected mid-stream.
        gone = asyncio.run(_leave_after_two_chunks(server, key))
        server.wait_idle()

        # In flight at SIGTERM: aborted at once (--shutdown-timeout 0), in-band.
        events: list = []
        started = threading.Event()
        long_body = {"model": MODEL, "prompt": "Long", "max_tokens": 480, "stream": True}
        reader = _stream_in_thread(server, key, {**long_body, "ignore_eos": True}, events, started)
        assert started.wait(60)
        # A burst just before the signal: rows still queued in the recorder at shutdown.
        for body in asyncio.run(_burst(server, key, 20)):
            finished(body)
        server.signal(signal.SIGTERM)
        reader.join(60)
        assert server.proc.wait(timeout=60) == 0
        client.close()

        aborted_id = json.loads(events[0])["id"]
        assert json.loads(events[-2])["error"]["type"] == "service_unavailable"
        rows = ledger(url)

    assert set(rows) == {*expected, gone, aborted_id}
    for rid, (prompt, completion, reason, status) in expected.items():
        row = rows[rid]
        assert (row.prompt_tokens, row.completion_tokens) == (prompt, completion), rid
        assert (row.finish_reason, row.status_code) == (reason, status), rid
        assert row.key_id == key_id and row.model == MODEL
        assert row.latency > 0 and row.queue_time is not None and row.queue_time >= 0
    row = rows[gone]
    assert (row.status_code, row.finish_reason) == (499, "abort")
    assert 2 <= row.completion_tokens < 400 and row.prompt_tokens > 0
    row = rows[aborted_id]
    assert (row.status_code, row.finish_reason) == (503, "abort")
    assert 1 <= row.completion_tokens < 480


def test_a_whole_answer_left_early_is_billed_every_token_made(
    start_server, tiny_llama_dir, tmp_path
):
    """A non-streamed request gets the engine's first and last outputs only; its client leaves
    mid-way: the row bills what the engine made until the abort (its final output, which the
    closing request waits for), not the one token of the first output."""
    with fresh_database("sqlite", tmp_path) as url:
        server = start_keys_server(start_server, tiny_llama_dir, tmp_path, url)
        key_id, key = Admin(server).create_key("early", rpm_limit=1000, token_budget=10**9)
        before = server.stats()["generation_tokens_total"]

        async def leave() -> None:
            body = {"model": MODEL, "prompt": "Bye", "max_tokens": 480, "ignore_eos": True}
            async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
                answer = asyncio.ensure_future(
                    c.post("/v1/completions", json=body, headers=bearer(key))
                )
                while (await asyncio.to_thread(server.stats))["generation_tokens_total"] < (
                    before + 20
                ):
                    assert not answer.done(), answer.result().text
                    await asyncio.sleep(0.02)
                answer.cancel()  # the connection closes mid-answer

        asyncio.run(leave())
        made = server.wait_idle()["generation_tokens_total"] - before
        assert server.stop() == 0
        (row,) = [r for r in ledger(url).values() if r.key_id == key_id]
    assert (row.status_code, row.finish_reason) == (499, "abort")
    assert 20 <= row.completion_tokens <= made < 480
