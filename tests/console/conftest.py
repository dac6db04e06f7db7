"""Console fixtures: the real app (api.server.app.create_app) with the console router, a real
AsyncEngine on the tiny Llama, a real SQLite key database, driven in-process by Litestar's
AsyncTestClient on the test's own event loop (so the engine's streams work)."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

import pytest_asyncio
import torch
from litestar.testing import AsyncTestClient

from api.db.session import Database
from api.keys.auth import Authenticator
from api.keys.service import KeyService
from api.server.app import create_app
from api.server.metrics import Metrics
from api.server.settings import Settings
from api.tenants.service import TenantService
from api.usage.service import UsageRecorder
from console import create_console_router
from engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.async_engine import AsyncEngine

ADMIN = "admin-token-for-console-tests"
MODEL = "tiny"
NUM_BLOCKS = 64


class Env:
    def __init__(self, app, engine, db, keys, recorder, metrics) -> None:
        self.app, self.engine, self.db, self.keys = app, engine, db, keys
        self.recorder, self.metrics = recorder, metrics


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def env(tiny_llama_dir, tmp_path_factory) -> AsyncIterator[Env]:
    torch.set_num_threads(1)
    url = f"sqlite+aiosqlite:///{tmp_path_factory.mktemp('console-db') / 'tessera.db'}"
    db = Database.from_url(url)
    await db.upgrade()
    config = EngineConfig(
        model=ModelConfig(model=str(tiny_llama_dir), dtype="float32", max_model_len=256),
        cache=CacheConfig(num_blocks=NUM_BLOCKS),
        scheduler=SchedulerConfig(max_num_seqs=8, max_model_len=256),
        served_model_name=MODEL,
    )
    engine = await AsyncEngine.create(config)
    # The app opens the same SQLite file; the test attaches its own services below.
    settings = Settings(
        model=str(tiny_llama_dir), served_model_name=MODEL, admin_token=ADMIN, database_url=url
    )
    app = create_app(settings, engine)
    if not any(route.path == "/console/login" for route in app.routes):
        app = create_app(settings, engine, extra_route_handlers=[create_console_router()])
    metrics = app.state.get("metrics") or Metrics(MODEL)
    keys = KeyService(db)
    recorder = UsageRecorder(db)
    app.state.keys = keys
    app.state.tenants = TenantService(db)
    app.state.usage_recorder = recorder
    app.state.metrics = metrics
    app.state.authenticator = Authenticator(
        db, mode="keys", static_keys=[], admin_token=ADMIN, cache_ttl=2.0
    )
    yield Env(app, engine, db, keys, recorder, metrics)
    await engine.shutdown()
    await db.dispose()


@pytest_asyncio.fixture(loop_scope="module")
async def anon(env) -> AsyncIterator[AsyncTestClient]:
    """A client without a session."""
    async with AsyncTestClient(env.app) as client:
        yield client


@pytest_asyncio.fixture(loop_scope="module")
async def client(env) -> AsyncIterator[AsyncTestClient]:
    """A client logged in to the console; `client.csrf` is its session's CSRF token."""
    async with AsyncTestClient(env.app) as c:
        await login(c)
        page = await c.get("/console/settings")
        c.csrf = csrf_of(page.text)
        yield c


def csrf_of(html: str) -> str:
    m = re.search(r'name="_csrf" value="([^"]+)"', html)
    assert m, "no CSRF field in the page"
    return m.group(1)


async def login(client, token: str = ADMIN, next_path: str = "/console"):
    form = await client.get("/console/login")
    return await client.post(
        "/console/login",
        data={"token": token, "_csrf": csrf_of(form.text), "next": next_path},
        follow_redirects=False,
    )
