"""Console routes over the real app: session login/logout, CSRF, every page in full and as an
htmx partial, and what each page shows against the engine and the key database."""

from __future__ import annotations

import asyncio
import contextvars
import re
from datetime import UTC, datetime

import pytest
from litestar.testing import AsyncTestClient

from api.server import request_context
from api.usage.service import UsageRecord
from engine import SamplingParams
from engine.protocol import EngineRequest
from tests.console.conftest import ADMIN, NUM_BLOCKS, csrf_of, login

pytestmark = pytest.mark.asyncio(loop_scope="module")

# (path, the id of the element its htmx partial starts with)
PAGES = [
    ("/console", "live"),
    ("/console/requests", "requests-table"),
    ("/console/keys", "keys-panel"),
    ("/console/tenants", "tenants"),
    ("/console/usage", "usage"),
    ("/console/adapters", "adapters"),
    ("/console/settings", "settings"),
]
HX = {"HX-Request": "true"}


def count(html: str, pattern: str) -> int:
    return len(re.findall(pattern, html))


# -- sessions ---------------------------------------------------------------------------------


@pytest.mark.parametrize("path", [p for p, _ in PAGES] + ["/console/keys/abc/edit"])
async def test_pages_need_a_session(anon, path):
    r = await anon.get(path, follow_redirects=False)
    assert r.status_code == 302
    assert r.headers["location"] == f"/console/login?next={path}"
    # htmx would swap a followed redirect into the panel: it gets 401 + HX-Redirect instead.
    r = await anon.get(path, headers=HX, follow_redirects=False)
    assert r.status_code == 401 and r.headers["hx-redirect"] == "/console/login"


async def test_unsafe_routes_need_a_session(anon):
    for path in ("/console/keys", "/console/keys/x/revoke", "/console/requests/r/abort"):
        r = await anon.post(path, data={"name": "x"}, follow_redirects=False)
        assert r.status_code == 302 and r.headers["location"].startswith("/console/login")


async def test_static_files_are_public(anon):
    r = await anon.get("/console/static/vendor/htmx/htmx.min.js")
    assert r.status_code == 200 and "htmx" in r.text[:2000]
    assert (await anon.get("/console/static/console/console.css")).status_code == 200
    page = await anon.get("/console/login")
    assert "https://" not in page.text  # nothing from a CDN


async def test_login_sets_a_strict_session_cookie(env, anon):
    r = await login(anon, next_path="/console/usage")
    assert r.status_code == 302 and r.headers["location"] == "/console/usage"
    cookie = next(c for c in r.headers.get_list("set-cookie") if c.startswith("tessera_console="))
    flags = cookie.lower()
    assert "httponly" in flags and "samesite=strict" in flags and "path=/console" in flags
    assert "secure" not in flags  # plain http here
    assert (await anon.get("/console", follow_redirects=False)).status_code == 200


async def test_login_over_tls_marks_the_cookie_secure(env):
    async with AsyncTestClient(env.app, base_url="https://testserver.local") as tls:
        r = await login(tls)
        cookie = next(c for c in r.headers.get_list("set-cookie") if "tessera_console=" in c)
        assert "secure" in cookie.lower()


async def test_login_refusals(anon):
    r = await login(anon, token="wrong")
    assert r.status_code == 401 and "not the admin token" in r.text
    assert "tessera_console=" not in r.headers.get("set-cookie", "")
    # The login form's CSRF token is bound to its cookie: a forged post is refused.
    r = await anon.post(
        "/console/login", data={"token": ADMIN, "_csrf": "forged"}, follow_redirects=False
    )
    assert r.status_code == 403 and "expired" in r.text
    # An open redirect through ?next is not possible.
    r = await login(anon, next_path="https://evil.example/")
    assert r.headers["location"] == "/console"


async def test_logout_ends_the_session(env):
    async with AsyncTestClient(env.app) as c:
        await login(c)
        old = c.cookies.get("tessera_console")
        csrf = csrf_of((await c.get("/console/settings")).text)
        r = await c.post("/console/logout", data={"_csrf": csrf}, follow_redirects=False)
        assert r.status_code == 302 and r.headers["location"] == "/console/login"
        assert (await c.get("/console", follow_redirects=False)).status_code == 302
    # The old cookie, replayed, no longer works on this replica.
    async with AsyncTestClient(env.app) as replay:
        replay.cookies.set("tessera_console", old, path="/console")
        assert (await replay.get("/console", follow_redirects=False)).status_code == 302


async def test_tampered_cookie_is_refused(env):
    async with AsyncTestClient(env.app) as c:
        await login(c)
        value = c.cookies.get("tessera_console")
        expires, nonce, sig = value.split(".")
        c.cookies.set("tessera_console", f"{int(expires) + 10**6}.{nonce}.{sig}", path="/console")
        assert (await c.get("/console", follow_redirects=False)).status_code == 302


# -- CSRF -------------------------------------------------------------------------------------


async def test_csrf_is_required_on_every_unsafe_request(env, client):
    before = len(await env.keys.list())
    for headers, data in (({}, {}), ({}, {"_csrf": "nope"}), ({"X-CSRF-Token": "nope"}, {})):
        r = await client.post("/console/keys", data={"name": "x", **data}, headers=headers)
        assert r.status_code == 403
    r = await client.post("/console/logout", follow_redirects=False)
    assert r.status_code == 403
    assert len(await env.keys.list()) == before
    # The header form (what htmx sends) and the field form both pass.
    r = await client.post(
        "/console/keys", data={"name": "csrf-h"}, headers={"X-CSRF-Token": client.csrf, **HX}
    )
    assert r.status_code == 200 and "csrf-h" in r.text


async def test_every_form_carries_the_csrf_token(client):
    for path, _ in PAGES:
        html = (await client.get(path)).text
        forms = count(html, r'<form[^>]*method="post"')
        assert count(html, f'name="_csrf" value="{client.csrf}"') >= forms
        assert f'"X-CSRF-Token": "{client.csrf}"' in html  # htmx requests send it as a header


# -- pages: full and partial ------------------------------------------------------------------


@pytest.mark.parametrize(("path", "root"), PAGES)
async def test_full_page_and_partial(client, path, root):
    full = await client.get(path)
    assert full.status_code == 200 and full.headers["content-type"].startswith("text/html")
    assert full.text.startswith("<!doctype html>") and f'id="{root}"' in full.text
    assert "htmx.min.js" in full.text and 'action="/console/logout"' in full.text
    assert "default-src 'none'" in full.headers["content-security-policy"]
    assert full.headers["cache-control"] == "no-store"
    part = await client.get(path, headers=HX)
    assert part.status_code == 200
    assert part.text.lstrip().startswith(f'<div id="{root}"')
    assert "<html" not in part.text and "<nav" not in part.text


async def test_dashboard_live_values(env, client):
    html = (await client.get("/console")).text
    stats = env.engine.stats()
    kv = re.search(r'id="kv-usage">([0-9.]+)%<', html)
    assert kv and float(kv.group(1)) == pytest.approx(100 * stats.kv_cache_usage, abs=0.05)
    assert re.search(r'id="num-running">0<', html) and re.search(r'id="num-waiting">0<', html)
    # One cell per block (the pool is small): the reserved null block, then the rest.
    grid = re.search(r'<div id="block-map"[^>]*>(.*?)</div>', html, re.S).group(1)
    assert count(grid, r"<i class=") == NUM_BLOCKS and grid.startswith('<i class="b-n">')
    assert 'hx-trigger="every 1s"' in html and "<svg" in html


async def test_dashboard_shows_running_requests_and_used_blocks(env, client):
    ids = env.engine.tokenizer.encode("The quick brown fox jumps over the lazy dog")
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
    gen = env.engine.generate(EngineRequest("dash-1", ids, params))
    await anext(gen)
    try:
        html = (await client.get("/console", headers=HX)).text
        assert re.search(r'id="num-running">1<', html)
        assert float(re.search(r'id="kv-usage">([0-9.]+)%', html).group(1)) > 0
        grid = re.search(r'<div id="block-map"[^>]*>(.*?)</div>', html, re.S).group(1)
        assert count(grid, r'class="b-u"') >= 1
    finally:
        await gen.aclose()


async def test_requests_page_lists_and_aborts(env, client):
    ids = env.engine.tokenizer.encode("Hello world")
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    def start() -> None:  # as the HTTP request's task would: its X-Request-Id and tenant set
        request_context._request_id.set("client-rid-7")
        request_context.bind_tenant("tenant-t")
        env.metrics.request_started("req-abort-me", key_name="team-a")

    contextvars.copy_context().run(start)
    outputs = []

    async def consume():
        async for out in env.engine.generate(EngineRequest("req-abort-me", ids, params)):
            outputs.append(out)

    task = asyncio.create_task(consume())
    while not outputs:
        await asyncio.sleep(0.01)
    html = (await client.get("/console/requests", headers=HX)).text
    row = re.search(r"<tr>\s*<td><code class=\"rid\">req-abort-me</code>.*?</tr>", html, re.S)
    assert row and "running" in row.group(0) and "team-a" in row.group(0)
    assert '<code class="xrid">client-rid-7</code>' in row.group(0) and "tenant-t" in row.group(0)
    queue = re.search(r'<table id="queue-by-tenant".*?</table>', html, re.S).group(0)
    assert re.search(r"<td>tenant-t</td><td class=\"num\">1</td><td class=\"num\">0</td>", queue)
    assert f">{len(ids)}<" in row.group(0)  # prompt tokens
    r = await client.post(
        "/console/requests/req-abort-me/abort", headers={**HX, "X-CSRF-Token": client.csrf}
    )
    assert r.status_code == 200 and "Aborted req-abort-me" in r.text
    await asyncio.wait_for(task, 10)
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert (
        "req-abort-me"
        not in (await client.get("/console/requests", headers=HX)).text.split("Aborted")[-1]
    )
    env.metrics.request_aborted("req-abort-me")


async def test_keys_create_edit_rotate_revoke(env, client):
    post = {"headers": {**HX, "X-CSRF-Token": client.csrf}}
    r = await client.post(
        "/console/keys",
        data={"name": "team-b", "rpm_limit": "30", "allowed_models": "tiny, other"},
        **post,
    )
    assert r.status_code == 200
    secret = re.search(r'<code id="new-key-secret">(tsr-[A-Za-z0-9_-]+)</code>', r.text).group(1)
    assert 'data-copy="#new-key-secret"' in r.text
    record = next(k for k in await env.keys.list() if k.name == "team-b")
    assert record.rpm_limit == 30 and record.allowed_models == ("tiny", "other")
    assert (await env.app.state.authenticator.authenticate(f"Bearer {secret}")).key_name == "team-b"
    # The secret is shown once: the list never shows it again.
    assert secret not in (await client.get("/console/keys")).text

    edit = await client.get(f"/console/keys/{record.id}/edit", headers=HX)
    assert edit.status_code == 200 and 'value="30"' in edit.text and "<html" not in edit.text
    assert (await client.get(f"/console/keys/{record.id}/edit")).text.startswith("<!doctype")
    r = await client.post(
        f"/console/keys/{record.id}",
        data={"name": "team-b", "rpm_limit": "", "tpm_limit": "5000", "budget_period": "day"},
        **post,
    )
    assert r.status_code == 200 and "Saved team-b" in r.text
    assert 'id="key-editor" hx-swap-oob="true"' in r.text  # the editor closes
    record = await env.keys.get(record.id)
    assert record.rpm_limit is None and record.tpm_limit == 5000 and record.budget_period == "day"

    r = await client.post(f"/console/keys/{record.id}/rotate", data={"grace_seconds": "0"}, **post)
    rotated = re.search(r'id="new-key-secret">(tsr-[^<]+)<', r.text).group(1)
    assert rotated != secret and "rotated" in r.text

    r = await client.post(f"/console/keys/{record.id}/revoke", **post)
    assert r.status_code == 200 and "Revoked team-b" in r.text
    assert (await env.keys.get(record.id)).revoked_at is not None
    row = re.search(rf'<tr id="key-{record.id}".*?</tr>', r.text, re.S).group(0)
    assert "revoked" in row and "Revoke</button>" not in row
    with pytest.raises(Exception, match="revoked"):
        await env.app.state.authenticator.authenticate(f"Bearer {rotated}")


async def test_key_form_errors_are_shown(env, client):
    post = {"headers": {**HX, "X-CSRF-Token": client.csrf}}
    r = await client.post("/console/keys", data={"name": "bad", "rpm_limit": "lots"}, **post)
    assert r.status_code == 422 and "rpm_limit must be a whole number" in r.text
    r = await client.post("/console/keys", data={"name": "bad", "rpm_limit": "-3"}, **post)
    assert r.status_code == 422 and "rpm_limit must be a whole number from 1" in r.text
    r = await client.post("/console/keys", data={"name": " "}, **post)
    assert r.status_code == 422 and "name must be a non-empty string" in r.text
    r = await client.post("/console/keys/nope/revoke", **post)
    assert r.status_code == 422 and "no API key with id" in r.text
    assert (await client.get("/console/keys/nope/edit", headers=HX)).status_code == 404
    assert not [k for k in await env.keys.list() if k.name == "bad"]


async def test_usage_table_chart_and_filter(env, client):
    a, _ = await env.keys.create("usage-a")
    b, _ = await env.keys.create("usage-b")
    for i in range(3):
        env.recorder.record(
            UsageRecord(
                request_id=f"u-a{i}",
                key_id=a.id,
                model=MODEL_NAME,
                prompt_tokens=10,
                completion_tokens=5,
            )  # fmt: skip
        )
    env.recorder.record(
        UsageRecord(
            request_id="u-b",
            key_id=b.id,
            model=MODEL_NAME,
            prompt_tokens=100,
            completion_tokens=1,
            status_code=429,
        )  # fmt: skip
    )
    html = (await client.get("/console/usage?days=7")).text  # the page flushes the ledger
    today = datetime.now(UTC).strftime("%Y-%m-%d")
    row_a = re.search(rf"<tr><td>{today}</td><td>usage-a</td>(.*?)</tr>", html, re.S).group(1)
    assert [int(x) for x in re.findall(r">([0-9,]+)<", row_a)] == [3, 0, 30, 15, 0, 45]
    row_b = re.search(rf"<tr><td>{today}</td><td>usage-b</td>(.*?)</tr>", html, re.S).group(1)
    assert [int(x) for x in re.findall(r">([0-9,]+)<", row_b)] == [1, 1, 100, 1, 0, 101]
    assert html.count('<svg class="chart"') == 2 and 'class="bar s' in html
    part = (await client.get(f"/console/usage?key_id={a.id}&days=1", headers=HX)).text
    assert "usage-a" in part and "<td>usage-b</td>" not in part


async def test_settings_page_shows_config_without_secrets(env, client):
    html = (await client.get("/console/settings")).text
    assert ADMIN not in html
    assert "<th>block_size</th><td><code>16</code>" in html
    assert f"<th>num_blocks</th><td><code>{NUM_BLOCKS}</code>" in html
    assert "<th>served model name</th><td>tiny</td>" in html
    assert "<th>admin_token</th><td><code>set</code>" in html
    assert "<th>metrics_token</th><td><code>not set</code>" in html


MODEL_NAME = "tiny"


async def test_the_adapters_page_lists_name_owner_and_path(env, client):
    from api.lora.registry import AdapterRegistry

    r = await client.get("/console/adapters")
    assert r.status_code == 200 and "LoRA is off" in r.text  # this engine has no --enable-lora
    server = env.app.state.server
    registry = AdapterRegistry([])
    registry._add("sql", "/adapters/sql", None, None, "flag")
    registry._add("team", "/adapters/team", "tenant-1", None, "admin")
    registry.acquire("team")
    server.adapters = registry
    try:
        r = await client.get("/console/adapters", headers=HX)
    finally:
        server.adapters = None
    assert r.status_code == 200
    assert count(r.text, "<tr>") == 3  # the header and two adapters
    assert "/adapters/sql" in r.text and "public" in r.text and "--lora-modules" in r.text
    assert 'href="/console/tenants/tenant-1"' in r.text and "/adapters/team" in r.text
