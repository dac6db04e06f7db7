"""The console login's lockout over the real app (api.server.app.create_app: its Access builds the
throttle the console and the admin API share): wrong admin tokens from one client, then 429
with Retry-After even for the right token, until the window passes; a success resets the
count; the lockout is logged once and counted in /metrics.

The app runs without a model (the engine fails to load, as in tests/api/test_deny_by_default):
the login does not need one. Its window is 1 s so that a lockout can end within the test."""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio
from litestar.testing import AsyncTestClient

from api.server.app import create_app
from api.server.plugins import installed_routers
from api.server.settings import Settings
from tests.console.conftest import login as login_as

pytestmark = pytest.mark.asyncio(loop_scope="module")

ADMIN = "tsa-console-lockout-admin-token-0123456789"
MAX_FAILURES = 3
WINDOW_S = 1.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def client(tmp_path_factory) -> AsyncIterator[AsyncTestClient]:
    """One client (one address, "testclient") for the module: its lifespans run once."""
    tmp = tmp_path_factory.mktemp("lockout")
    settings = Settings(
        model=str(tmp / "no-model"),  # the engine fails to load: the login must not care
        data_dir=str(tmp),
        admin_token=ADMIN,
        login_max_failures=MAX_FAILURES,
        login_failure_window=WINDOW_S,
    )
    async with AsyncTestClient(create_app(settings, extra_route_handlers=installed_routers())) as c:
        yield c


@pytest_asyncio.fixture(loop_scope="module")
async def c(client) -> AsyncTestClient:
    client.cookies.clear()  # no session left from another test
    return client


async def login(client, token: str = ADMIN, next_path: str = "/console"):
    return await login_as(client, token, next_path)


def counter(text: str, name: str, surface: str) -> float:
    m = re.search(rf'^{re.escape(name)}\{{surface="{surface}"\}} (\S+)$', text, re.M)
    assert m, f"{name}{{surface={surface}}} not in /metrics"
    return float(m.group(1))


async def test_wrong_tokens_lock_the_client_out_even_for_the_right_token(c, caplog):
    before = (await c.get("/metrics")).text
    with caplog.at_level(logging.WARNING, logger="tessera.api"):
        for _ in range(MAX_FAILURES):
            r = await login(c, token="not-the-token")
            assert r.status_code == 401 and "not the admin token" in r.text
        r = await login(c)  # the right token, during the lockout
        assert r.status_code == 429
        assert r.headers["retry-after"] == "1"
        assert "Too many failed attempts" in r.text and "not even the right one" in r.text
        assert "tessera_console=" not in r.headers.get("set-cookie", "")
        assert (await c.get("/console", follow_redirects=False)).status_code == 302
        # The form is still served, so the page can be reloaded once the lockout ends.
        assert (await c.get("/console/login")).status_code == 200
    lockouts = [r for r in caplog.records if "Locked out" in r.getMessage()]
    assert len(lockouts) == 1, [r.getMessage() for r in caplog.records]
    assert lockouts[0].levelno == logging.WARNING
    assert "testclient" in lockouts[0].getMessage()  # the client's address
    assert "not-the-token" not in caplog.text and ADMIN not in caplog.text
    after = (await c.get("/metrics")).text
    for name, delta in (
        ("tessera:login_failures_total", MAX_FAILURES),
        ("tessera:login_lockouts_total", 1),
    ):
        assert counter(after, name, "console") - counter(before, name, "console") == delta

    await asyncio.sleep(WINDOW_S + 0.2)
    r = await login(c, next_path="/console/settings")
    assert r.status_code == 302 and r.headers["location"] == "/console/settings"
    assert (await c.get("/console/settings", follow_redirects=False)).status_code == 200


async def test_a_success_resets_the_count(c):
    for _ in range(MAX_FAILURES - 1):
        assert (await login(c, token="wrong")).status_code == 401
    assert (await login(c)).status_code == 302  # forgets the failures
    for _ in range(MAX_FAILURES - 1):
        assert (await login(c, token="wrong")).status_code == 401
    assert (await login(c)).status_code == 302  # not locked out: the count started over
    for _ in range(MAX_FAILURES):
        assert (await login(c, token="wrong")).status_code == 401
    assert (await login(c)).status_code == 429
    await asyncio.sleep(WINDOW_S + 0.2)
    assert (await login(c)).status_code == 302


async def test_a_stale_form_is_no_guess(c):
    """A post whose login-form token is forged is refused (403) before the admin token is
    looked at, so it does not count towards a lockout."""
    for _ in range(MAX_FAILURES + 2):
        r = await c.post(
            "/console/login", data={"token": "x", "_csrf": "forged"}, follow_redirects=False
        )
        assert r.status_code == 403
    assert (await login(c)).status_code == 302
