"""The console in real headless Chromium against a real `tessera serve` process: log in, see
the dashboard move under load without a reload, create a key and use it from the OpenAI SDK,
revoke it and see the SDK get 401. Screenshots go to test-artifacts/; with
TESSERA_UPDATE_SCREENSHOTS=1 the dashboard one also replaces docs/dashboard.png (the README's).

Chromium is Debian's (/usr/bin/chromium; installed with `apt-get install -y chromium` when
missing), driven by the playwright package: never `playwright install`.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import openai
import pytest

from api.keys.service import KeyService
from tests.api.conftest import ServerProcess
from tests.debian import ensure_debian_binary

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]
ADMIN = "browser-test-admin-token"
MODEL = "tiny"
NUM_BLOCKS = 512


def ensure_chromium() -> None:
    ensure_debian_binary(
        "chromium", "chromium", lambda: str(CHROMIUM) if CHROMIUM.exists() else None
    )


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("console-e2e")
    args = [
        str(tiny_llama_dir),
        "--served-model-name", MODEL,
        "--dtype", "float32",
        "--max-model-len", "512",
        "--num-kv-blocks", str(NUM_BLOCKS),
        "--admin-token", ADMIN,
        "--database-url", f"sqlite+aiosqlite:///{tmp / 'tessera.db'}",
    ]  # fmt: skip
    proc = ServerProcess(args, tmp / "server.log")
    proc.database_url = args[-1]
    try:
        proc.wait_healthy()
        if httpx.get(proc.base_url + "/console/login", timeout=10).status_code == 404:
            pytest.skip("the console router is not mounted by create_app yet")
        yield proc
    finally:
        proc.stop()


@pytest.fixture(scope="module")
def browser():
    ensure_chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.on("dialog", lambda dialog: dialog.accept())  # hx-confirm on revoke/abort
    errors: list[str] = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.goto(server.base_url + "/console")
    assert page.url.startswith(server.base_url + "/console/login")
    page.fill("input[name=token]", ADMIN)
    page.click("button[type=submit]")
    page.wait_for_url(server.base_url + "/console")
    yield page
    context.close()
    assert not errors, f"browser console errors: {errors}"  # CSP violations show up here


def create_key(page, server, name: str) -> str:
    page.goto(server.base_url + "/console/keys")
    page.fill("#create-key input[name=name]", name)
    page.click("#create-key button[type=submit]")
    secret = page.locator("#new-key-secret")
    secret.wait_for()
    return secret.inner_text().strip()


def sdk(server, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=60)


def number(page, element_id: str) -> float:
    return float(page.locator(f"#{element_id}").inner_text().rstrip("%"))


def test_key_created_in_console_works_until_revoked(page, server):
    key = create_key(page, server, "browser-key")
    assert key.startswith("tsr-")
    client = sdk(server, key)
    r = client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0)
    assert r.usage.completion_tokens >= 1
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "keys.png"), full_page=True)

    row = page.locator("tr[data-key-name='browser-key']")
    row.locator("button[data-action=revoke]").click()
    page.locator("tr[data-key-name='browser-key'] .pill.revoked").wait_for()
    with pytest.raises(openai.AuthenticationError) as err:
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=3)
    assert err.value.status_code == 401


class Load:
    """Streams that keep the engine busy from a background thread until stopped."""

    def __init__(self, client: openai.OpenAI, streams: int, max_tokens: int) -> None:
        self.client, self.max_tokens = client, max_tokens
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(streams)]

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                stream = self.client.completions.create(
                    model=MODEL,
                    prompt="The quick brown fox jumps over the lazy dog, again and again.",
                    max_tokens=self.max_tokens,
                    stream=True,
                    extra_body={"ignore_eos": True},
                )
                with contextlib.closing(stream):
                    for _ in stream:
                        if self.stop.is_set():
                            break
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                self.errors.append(exc)
                return

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(60)


def test_dashboard_moves_under_load_without_reload(page, server):
    key = create_key(page, server, "load-key")
    page.goto(server.base_url + "/console")
    assert number(page, "num-running") == 0 and number(page, "kv-usage") == 0
    cells = page.locator("#block-map i").count()
    assert cells == NUM_BLOCKS  # one cell per block at this pool size
    page.evaluate("window.__sameDocument = true")

    with Load(sdk(server, key), streams=24, max_tokens=400) as load:
        page.wait_for_function(
            "() => parseInt(document.querySelector('#num-running').textContent) > 0",
            timeout=60_000,
        )
        page.wait_for_function(
            "() => parseFloat(document.querySelector('#kv-usage').textContent) > 5",
            timeout=60_000,
        )
        # Let the throughput chart gather a few samples, then take the picture.
        page.wait_for_timeout(4000)
        assert page.locator("#block-map i.b-u").count() > 0
        assert page.evaluate("window.__sameDocument") is True  # polled, not reloaded
        ARTIFACTS.mkdir(exist_ok=True)
        shot = ARTIFACTS / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        if os.environ.get("TESSERA_UPDATE_SCREENSHOTS"):  # refresh the README's picture
            shutil.copyfile(shot, REPO / "docs" / "dashboard.png")
        page.goto(server.base_url + "/console/requests")
        page.locator("#requests-table code.rid").first.wait_for()
        page.screenshot(path=str(ARTIFACTS / "requests.png"), full_page=True)
    assert not load.errors, load.errors

    # When the load stops, the dashboard drains back to idle on its own.
    page.goto(server.base_url + "/console")
    page.wait_for_function(
        "() => document.querySelector('#num-running').textContent.trim() === '0'"
        " && document.querySelector('#kv-usage').textContent.trim() === '0.0%'",
        timeout=60_000,
    )


def add_usage(database_url: str, key_name: str, per_day: list[int]) -> None:
    """Ledger rows for key_name: per_day[i] requests (10 + 5 tokens each) i days ago."""
    from api.db.session import Database
    from api.usage.service import UsageRecord, UsageRecorder

    async def write() -> None:
        db = Database.from_url(database_url)
        try:
            key = next(k for k in await KeyService(db).list() if k.name == key_name)
            recorder = UsageRecorder(db)
            now = datetime.now(UTC)
            for days_ago, n in enumerate(per_day):
                for i in range(n):
                    recorder.record(
                        UsageRecord(
                            request_id=f"{key_name}-{days_ago}-{i}",
                            key_id=key.id,
                            model=MODEL,
                            prompt_tokens=10,
                            completion_tokens=5,
                            created_at=now - timedelta(days=days_ago),
                        )
                    )
            assert await recorder.flush()
        finally:
            await db.dispose()

    # Playwright's sync API owns this thread's event loop: write from another thread.
    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: asyncio.run(write())).result(60)


def test_usage_page_table_chart_and_filter(page, server):
    create_key(page, server, "usage-1")
    create_key(page, server, "usage-2")
    add_usage(server.database_url, "usage-1", [3, 0, 2, 5])
    add_usage(server.database_url, "usage-2", [1, 4])
    page.goto(server.base_url + "/console/usage?days=7")
    # Earlier tests' real traffic (browser-key, load-key) has rows of its own today.
    rows = page.locator("#usage-table tbody tr").filter(has_text="usage-")
    assert rows.count() == 5  # one row per key and day with traffic
    assert page.locator("#usage svg.chart rect.bar").count() >= 5
    today = rows.filter(has_text="usage-1").first.locator("td").all_inner_texts()
    assert today[2:] == ["3", "0", "30", "15", "0", "45"]
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "usage.png"), full_page=True)
    # Filtering by key swaps the results in place and keeps the URL shareable.
    page.evaluate("window.__sameDocument = true")
    page.select_option("select[name=key_id]", label="usage-2")
    page.wait_for_function(
        "() => !document.querySelector('#usage-table').innerText.includes('usage-1')"
    )
    assert rows.count() == 2 and "key_id=" in page.url
    assert page.evaluate("window.__sameDocument") is True


def add_tenant_usage(database_url: str, tokens: dict[str, int]) -> None:
    """One recent ledger row per tenant (by id) of that many prompt tokens."""
    from api.db.session import Database
    from api.usage.service import UsageRecord, UsageRecorder

    async def write() -> None:
        db = Database.from_url(database_url)
        try:
            recorder = UsageRecorder(db)
            for tenant_id, n in tokens.items():
                recorder.record(UsageRecord(request_id=f"t-{tenant_id}", key_id=None,
                                            model=MODEL, prompt_tokens=n, tenant_id=tenant_id))  # fmt: skip
            assert await recorder.flush()
        finally:
            await db.dispose()

    with ThreadPoolExecutor(1) as pool:
        pool.submit(lambda: asyncio.run(write())).result(60)


def _percent(row) -> tuple[int, int]:
    cells = row.locator("td").all_inner_texts()
    return int(cells[2].rstrip("%")), int(cells[3].rstrip("%"))  # weight share, token share


def test_tenants_pages_show_weight_beside_share(page, server):
    admin = {"Authorization": f"Bearer {ADMIN}"}
    made = {}
    for name, weight in (("team-heavy", 1), ("team-light", 3)):
        r = httpx.post(server.base_url + "/admin/v1/tenants", headers=admin, timeout=30,
                       json={"name": name, "weight": weight, "rpm_limit": 100})  # fmt: skip
        assert r.status_code == 201, r.text
        made[name] = r.json()["id"]
    r = httpx.post(server.base_url + "/admin/v1/keys", headers=admin, timeout=30,
                   json={"name": "light-key", "tenant_id": made["team-light"]})  # fmt: skip
    assert r.status_code == 201
    # Millions of tokens, so earlier tests' real traffic is lost in the rounding.
    add_tenant_usage(server.database_url, {made["team-heavy"]: 3_000_000,
                                           made["team-light"]: 1_000_000})  # fmt: skip
    page.goto(server.base_url + "/console/tenants?minutes=15")
    rows = page.locator("#tenants-table tbody tr")
    heavy = rows.filter(has_text="team-heavy")
    light = rows.filter(has_text="team-light")
    # 3 : 1 of the tokens (other tenants' traffic from earlier tests in the window takes a
    # share too, so the two need not add up to exactly 100%).
    heavy_share, light_share = _percent(heavy)[1], _percent(light)[1]
    assert 70 <= heavy_share <= 75 and abs(heavy_share - 3 * light_share) <= 3
    assert abs(_percent(light)[0] - 3 * _percent(heavy)[0]) <= 3  # weights 3 : 1
    assert "rpm 100" in heavy.inner_text()
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "tenants.png"), full_page=True)
    page.click("text=team-light")
    page.wait_for_url(f"**/console/tenants/{made['team-light']}")
    assert "light-key" in page.locator("#tenant-keys").inner_text()
    assert f"{light_share}%" in page.locator("#tenant-share").inner_text()


@pytest.mark.parametrize(
    "path", ["/console", "/console/keys", "/console/usage", "/console/tenants"]
)
def test_pages_fit_a_phone(page, server, path):
    page.set_viewport_size({"width": 390, "height": 844})
    page.goto(server.base_url + path)
    time.sleep(0.2)
    overflow = page.evaluate("document.documentElement.scrollWidth")
    assert overflow <= 391, f"{path} is {overflow}px wide at phone width"
    ARTIFACTS.mkdir(exist_ok=True)
    name = path.strip("/").replace("/", "-")
    page.screenshot(path=str(ARTIFACTS / f"phone-{name}.png"), full_page=True)
