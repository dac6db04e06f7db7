"""Deny by default, in-process: every route of the real app refuses a request without
credentials — except /health, /version, /metrics (open unless --metrics-require-admin), the
API docs and the console's login page and static files — and the decision is made on the
matched route, whatever the Host header or path spelling says.
"""

from __future__ import annotations

import re

import pytest
from litestar.routes import HTTPRoute
from litestar.testing import TestClient

from api.server.app import create_app
from api.server.plugins import installed_routers
from api.server.settings import Settings

ADMIN = "tsa-deny-by-default-admin-token"
OPEN = {"/health", "/version"}


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("deny")
    settings = Settings(
        model=str(tmp / "no-model"),  # the engine fails to load: auth must not care
        data_dir=str(tmp),
        admin_token=ADMIN,
        metrics_require_admin=True,
    )
    with TestClient(create_app(settings, extra_route_handlers=installed_routers())) as c:
        yield c


def routes(app) -> list[tuple[str, str]]:
    out = []
    for route in app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        path = re.sub(r"\{[^}]+\}", "x", route.path)
        for method in sorted(route.methods - {"HEAD", "OPTIONS"}):
            out.append((method, path))
    return out


def test_every_route_but_the_open_ones_needs_credentials(client):
    checked = 0
    for method, path in routes(client.app):
        if path in OPEN or path.startswith(("/docs", "/console/static", "/console/login")):
            continue
        r = client.request(method, path, content=b"{}", follow_redirects=False)
        if path.startswith("/console"):
            assert r.status_code in (302, 401), (method, path, r.status_code)
            continue
        assert r.status_code == 401, (method, path, r.status_code, r.text)
        if path.startswith("/v1/messages"):  # Anthropic's error body (api/anthropic/errors.py)
            assert r.json()["error"]["type"] == "authentication_error"
        else:
            assert r.json()["error"]["code"] == "invalid_api_key"
        checked += 1
    assert checked >= 14  # /v1 (3), /v1/messages (2), tokenizer (2), admin (8), /metrics


def test_open_routes(client):
    assert client.get("/version").status_code == 200
    assert client.get("/health").status_code == 503  # open, and honest: no engine
    assert client.get("/console/login").status_code == 200


def test_metrics_behind_the_admin_token_when_asked(client):
    assert client.get("/metrics").status_code == 401
    r = client.get("/metrics", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and "tessera:http_requests_total" in r.text


@pytest.mark.parametrize(
    "path, headers",
    [
        ("/v1/models", {"Host": "localhost/health"}),
        ("/v1/models", {"Host": "x", "X-Forwarded-Host": "localhost", "X-Original-URL": "/health"}),
        ("/v1/models/", {}),
        ("//v1/models", {}),
        ("/v1/./models", {}),
        ("/v1/models?/health", {}),
        ("/admin/v1/keys", {"X-Forwarded-Prefix": "/health"}),
    ],
)
def test_the_matched_route_decides(client, path, headers):
    r = client.get(path, headers=headers)
    assert r.status_code in (400, 401, 404), (path, r.status_code)  # refused, never served
    assert "error" in r.json()


def test_the_admin_token_is_needed_for_admin_routes(client):
    r = client.get("/admin/v1/keys", headers={"Authorization": "Bearer tsr-" + "A" * 43})
    assert r.status_code == 401
    r = client.get("/admin/v1/keys", headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.json()["data"][0]["name"] == "default"
