"""/docs from vendored assets behind a CSP, and the error envelope in the OpenAPI document."""

from __future__ import annotations

import re

import pytest
from litestar.testing import TestClient

from api.anthropic.errors import ERROR_SCHEMA as ANTHROPIC_ERROR_SCHEMA
from api.server.app import create_app
from api.server.openapi import ERROR_SCHEMA
from api.server.settings import Settings


@pytest.fixture(scope="module")
def client():
    with TestClient(create_app(Settings(model="unused", api_key=["k1"]))) as c:
        yield c


def test_docs_page_is_offline_with_a_csp(client):
    r = client.get("/docs")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    csp = r.headers["content-security-policy"]
    assert "script-src 'self'" in csp and "default-src 'none'" in csp
    assert "<script>" not in r.text  # no inline script: the CSP needs no 'unsafe-inline'
    urls = re.findall(r'(?:src|href)="([^"]+)"', r.text)
    assert urls and all(u.startswith("/docs/static/") for u in urls), urls
    for url in urls:
        asset = client.get(url)
        assert asset.status_code == 200 and len(asset.content) > 0, url
        assert "content-security-policy" in asset.headers
    assert client.get("/docs/static/index.html").status_code == 404  # a whitelist only
    assert client.get("/docs/static/..%2Fpyproject.toml").status_code == 404


def test_openapi_documents_the_error_envelope(client):
    doc = client.get("/docs/openapi.json").json()
    assert ERROR_SCHEMA in doc["components"]["schemas"]
    ref = {"$ref": f"#/components/schemas/{ERROR_SCHEMA}"}
    want = {
        ("/v1/chat/completions", "post"): {400, 401, 403, 404, 413, 415, 429, 503},
        ("/v1/completions", "post"): {400, 401, 403, 404, 413, 415, 429, 503},
        ("/tokenize", "post"): {400, 401, 403, 404, 413, 415, 503},
        ("/v1/models", "get"): {401, 503},
    }
    for (path, method), statuses in want.items():
        responses = doc["paths"][path][method]["responses"]
        assert {int(s) for s in responses if s != "200"} == statuses, path
        for s in statuses:
            assert responses[str(s)]["content"]["application/json"]["schema"] == ref
    assert "503" in doc["paths"]["/health"]["get"]["responses"]


def test_openapi_documents_the_anthropic_routes_with_their_error_body(client):
    doc = client.get("/docs/openapi.json").json()
    ref = {"$ref": f"#/components/schemas/{ANTHROPIC_ERROR_SCHEMA}"}
    error = doc["components"]["schemas"][ANTHROPIC_ERROR_SCHEMA]
    assert error["required"] == ["type", "error"]
    want = {
        "/v1/messages": {400, 401, 403, 404, 413, 415, 429, 503},
        "/v1/messages/count_tokens": {400, 401, 403, 404, 413, 415, 503},
    }
    for path, statuses in want.items():
        responses = doc["paths"][path]["post"]["responses"]
        assert {int(s) for s in responses if s != "200"} == statuses, path
        for s in statuses:
            assert responses[str(s)]["content"]["application/json"]["schema"] == ref
    body = doc["components"]["schemas"]["MessagesRequest"]
    assert body["additionalProperties"] is False and "max_tokens" in body["required"]
