"""The app in-process (Litestar's TestClient): the error envelope for Litestar's own errors,
auth before body parsing, 503 when the engine is not there (failed to load), and what the
lifespan does around a loaded engine (the collector's freeze)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
from litestar.testing import TestClient

from api.server.app import create_app
from api.server.settings import Settings


def wait_for_status(client: TestClient, word: str, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = client.get("/health").json()
        if body["status"] == word or time.monotonic() > deadline:
            return body
        time.sleep(0.05)


@pytest.fixture(scope="module")
def failed_client(tmp_path_factory):
    missing = tmp_path_factory.mktemp("nomodel") / "does-not-exist"
    app = create_app(Settings(model=str(missing), auth="none"))
    with TestClient(app) as client:
        wait_for_status(client, "failed")
        yield client


def test_engine_that_failed_to_load_gives_503(failed_client):
    health = failed_client.get("/health")
    assert health.status_code == 503
    assert health.json()["status"] == "failed" and health.json()["error"]
    r = failed_client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 503 and int(r.headers["Retry-After"]) >= 1
    err = r.json()["error"]
    assert err["type"] == "service_unavailable" and "failed to start" in err["message"]
    # The process keeps answering the system routes.
    assert failed_client.get("/version").status_code == 200
    assert failed_client.get("/docs/openapi.json").status_code == 200


def test_litestar_errors_use_the_openai_envelope(failed_client):
    r = failed_client.get("/v1/does-not-exist")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = failed_client.get("/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["type"] == "invalid_request_error"
    r = failed_client.post("/v1/completions", json={"model": "m", "prompt": "x", "n": "two"})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "n" and "`n`" in r.json()["error"]["message"]
    r = failed_client.post(
        "/v1/completions", content=b"{oops", headers={"Content-Type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_auth_keys_refuses_missing_and_unknown_keys(tmp_path):
    app = create_app(Settings(model="unused", auth="keys", data_dir=str(tmp_path)))
    with TestClient(app) as client:
        r = client.post("/v1/completions", json={"model": "m", "prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        assert "Missing API key" in r.json()["error"]["message"]
        r = client.post(
            "/v1/completions",
            json={"model": "m", "prompt": "x"},
            headers={"Authorization": "Bearer x"},
        )
        assert r.status_code == 401
        assert r.json()["error"]["message"] == "Incorrect API key provided."
        # /health and /version need no key.
        assert client.get("/version").status_code == 200
    assert (tmp_path / "tessera.db").is_file() and (tmp_path / "admin_token").is_file()


def test_static_keys_checked_before_the_body():
    app = create_app(Settings(model="unused", api_key=["k1", "k2"]))
    with TestClient(app) as client:
        bad = {"Authorization": "Bearer k3", "Content-Type": "application/json"}
        r = client.post("/v1/completions", content=b"{oops", headers=bad)
        assert (
            r.status_code == 401 and r.json()["error"]["message"] == "Incorrect API key provided."
        )
        good = {"Authorization": "Bearer k2", "Content-Type": "application/json"}
        r = client.post("/v1/completions", content=b"{oops", headers=good)
        assert r.status_code == 400  # past auth: now the body is read


@pytest.mark.slow
def test_serve_exits_1_when_the_model_cannot_load(tmp_path):
    missing = tmp_path / "no-such-model"
    proc = subprocess.run(
        [sys.executable, "-m", "api.cli", "serve", str(missing), "--auth", "none", "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1
    assert "not found" in proc.stderr + proc.stdout


def test_the_loaded_engine_is_frozen_out_of_the_collector_until_stop(tiny_llama_dir):
    """After the engine loads, the objects alive then (model, tokenizer, imports) are frozen:
    a full collection no longer walks them with the GIL held; stopping the server unfreezes."""
    import gc

    assert gc.get_freeze_count() == 0
    settings = Settings(model=str(tiny_llama_dir), auth="none", served_model_name="tiny")
    app = create_app(settings)
    with TestClient(app) as client:
        assert wait_for_status(client, "ok")["status"] == "ok"
        assert gc.get_freeze_count() > 10_000
        r = client.post("/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert gc.get_freeze_count() == 0
