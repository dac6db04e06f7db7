"""What the server says about itself agrees with what it does, in-process (no model: the
engine fails to load, which none of this needs):

- OPTIONS on every path answers Allow with every method the path serves, and a method it
  does not serve is a 405 with the same Allow (Litestar 2 listed only the handlers
  registered before its automatic OPTIONS handler: `OPTIONS, POST` on /admin/v1/keys);
- a request body refuses unknown fields exactly where the OpenAPI document says
  `additionalProperties: false` (and nowhere under --lenient-request-fields where the
  server then accepts them);
- a body the document marks required is refused when left out, and one it marks optional
  (key rotation) is not;
- /admin/v1/usage takes since/until in the formats the document describes, and refuses
  anything else with a 400 naming the parameter (0.5 was 1970-01-01T00:00:00.5Z).
"""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta

import pytest
from litestar.routes import HTTPRoute
from litestar.testing import TestClient

from api.server.app import create_app
from api.server.plugins import installed_routers
from api.server.settings import Settings

ADMIN = "tsa-openapi-agreement-admin-token"
UNKNOWN = "zz_not_a_field"
# A body each operation takes; the test fails when a route with a body is added without one.
MINIMAL = {
    ("post", "/v1/chat/completions"): {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
    },
    ("post", "/v1/completions"): {"model": "m", "prompt": "hi"},
    ("post", "/v1/embeddings"): {"model": "m", "input": "hi"},
    ("post", "/tokenize"): {"prompt": "hi"},
    ("post", "/v1/responses"): {"model": "m", "input": "hi", "store": False},
    ("post", "/v1/messages"): {
        "model": "m",
        "max_tokens": 1,
        "messages": [{"role": "user", "content": "hi"}],
    },
    ("post", "/v1/messages/count_tokens"): {
        "model": "m",
        "messages": [{"role": "user", "content": "hi"}],
    },
    ("post", "/detokenize"): {"tokens": [1]},
    ("post", "/admin/v1/keys"): {"name": "another"},
    ("post", "/admin/v1/tenants"): {"name": "another"},
    ("patch", "/admin/v1/keys/{key_id}"): {},
    ("patch", "/admin/v1/tenants/{tenant_id}"): {},
    ("post", "/admin/v1/keys/{key_id}/rotate"): {},
    ("post", "/admin/v1/lora_adapters"): {"lora_name": "a", "lora_path": "/nowhere"},
    ("post", "/v1/load_lora_adapter"): {"lora_name": "a", "lora_path": "/nowhere"},
    ("post", "/v1/unload_lora_adapter"): {"lora_name": "a"},
}


class Env:
    def __init__(self, client: TestClient) -> None:
        self.client = client
        self.admin = {"Authorization": f"Bearer {ADMIN}"}
        created = client.post("/admin/v1/keys", json={"name": "agree"}, headers=self.admin)
        assert created.status_code == 201, created.text
        self.key_id = created.json()["id"]
        self.user = {"Authorization": f"Bearer {created.json()['key']}"}
        tenant = client.post("/admin/v1/tenants", json={"name": "agree"}, headers=self.admin)
        self.tenant_id = tenant.json()["id"]
        self.doc = client.get("/docs/openapi.json").json()

    def headers(self, path: str) -> dict[str, str]:
        admin = path.startswith("/admin") or path.endswith("_lora_adapter")
        return self.admin if admin else self.user

    def url(self, path: str) -> str:
        return path.replace("{key_id}", self.key_id).replace("{tenant_id}", self.tenant_id)

    def send(self, method: str, path: str, body: object = None, raw: bytes | None = None):
        content = raw if raw is not None else None if body is None else json.dumps(body).encode()
        headers = dict(self.headers(path))
        if content is not None:
            headers["content-type"] = "application/json"
        return self.client.request(method, self.url(path), headers=headers, content=content)

    def body_schema(self, method: str, path: str) -> tuple[bool, dict]:
        """(required, the body's object schema) as the document says."""
        body = self.doc["paths"][path][method]["requestBody"]
        schema = body["content"]["application/json"]["schema"]
        refs = [schema] + schema.get("oneOf", [])
        name = next(s["$ref"] for s in refs if "$ref" in s).rsplit("/", 1)[1]
        return body.get("required", False), self.doc["components"]["schemas"][name]


def _settings(tmp, **kw) -> Settings:
    return Settings(model=str(tmp / "no-model"), data_dir=str(tmp), admin_token=ADMIN, **kw)


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    with TestClient(
        create_app(
            _settings(tmp_path_factory.mktemp("agree")), extra_route_handlers=installed_routers()
        )
    ) as client:
        yield Env(client)


@pytest.fixture(scope="module")
def lenient(tmp_path_factory):
    settings = _settings(tmp_path_factory.mktemp("lenient"), lenient_request_fields=True)
    with TestClient(create_app(settings, extra_route_handlers=installed_routers())) as client:
        yield Env(client)


# --- OPTIONS and 405 ---------------------------------------------------------------------------


def _console_login(client: TestClient) -> None:
    page = client.get("/console/login")
    csrf = re.search(r'name="_csrf" value="([^"]+)"', page.text).group(1)
    r = client.post(
        "/console/login",
        data={"token": ADMIN, "_csrf": csrf, "next": "/console"},
        follow_redirects=False,
    )
    assert r.status_code in (302, 303), r.text


def _allow(response) -> set[str]:
    return {m.strip() for m in response.headers.get("allow", "").split(",") if m.strip()}


def test_options_and_405_list_every_method_a_path_serves(env):
    _console_login(env.client)  # the console's routes answer a session only
    checked = 0
    for route in env.client.app.routes:
        if not isinstance(route, HTTPRoute):
            continue
        path = re.sub(r"\{[^}]+\}", "x", route.path)
        served = set(route.methods)
        r = env.client.options(path, headers=env.headers(path), follow_redirects=False)
        assert r.status_code == 204, (path, r.status_code, r.text)
        assert _allow(r) == served, (path, r.headers.get("allow"), sorted(served))
        other = next(m for m in ("PUT", "DELETE", "PATCH", "POST", "GET") if m not in served)
        r = env.client.request(other, path, headers=env.headers(path), follow_redirects=False)
        assert r.status_code == 405, (other, path, r.status_code)
        assert _allow(r) == served, (other, path, r.headers.get("allow"))
        checked += 1
    assert checked >= 25, checked
    r = env.client.options("/admin/v1/keys", headers=env.admin)  # the issue's own
    assert _allow(r) == {"GET", "POST", "OPTIONS"}


# --- unknown fields ----------------------------------------------------------------------------


def _operations_with_bodies(doc) -> set[tuple[str, str]]:
    return {
        (method, path)
        for path, item in doc["paths"].items()
        for method, op in item.items()
        if isinstance(op, dict) and "requestBody" in op
    }


def _refuses(response, field: str) -> bool:
    return response.status_code == 400 and field in response.json()["error"]["message"]


def test_bodies_refuse_unknown_fields_where_the_document_says_so(env):
    assert _operations_with_bodies(env.doc) == set(MINIMAL)
    closed = set()
    for (method, path), body in MINIMAL.items():
        _, schema = env.body_schema(method, path)
        plain = env.send(method, path, body)
        assert plain.status_code != 400, (method, path, plain.text)  # 503: no engine here
        extra = env.send(method, path, {**body, UNKNOWN: 1})
        if schema.get("additionalProperties") is False:
            closed.add(path)
            assert _refuses(extra, UNKNOWN), (method, path, extra.status_code, extra.text)
        else:
            assert extra.status_code == plain.status_code, (method, path, extra.text)
    assert closed == {path for _, path in MINIMAL} - {"/tokenize", "/detokenize"}, closed


def test_the_fields_accepted_without_effect_or_only_when_harmless_are_documented(env):
    props = env.doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]
    assert "Accepted" in props["store"]["description"]
    assert props["use_beam_search"]["enum"] == [None, False]
    chat = MINIMAL[("post", "/v1/chat/completions")]
    assert env.send("post", "/v1/chat/completions", {**chat, "store": True}).status_code == 503
    harmful = env.send("post", "/v1/chat/completions", {**chat, "use_beam_search": True})
    assert harmful.status_code == 400 and harmful.json()["error"]["param"] == "use_beam_search"


def test_lenient_request_fields_documents_and_accepts_unknown_fields(lenient):
    for method, path in [("post", "/v1/chat/completions"), ("post", "/v1/completions")]:
        _, schema = lenient.body_schema(method, path)
        assert "additionalProperties" not in schema and "store" in schema["properties"]
        r = lenient.send(method, path, {**MINIMAL[(method, path)], UNKNOWN: 1})
        assert r.status_code == 503, r.text  # past the field check: the engine is absent
    _, key_create = lenient.body_schema("post", "/admin/v1/keys")
    assert key_create["additionalProperties"] is False  # the admin bodies stay strict


# --- required and optional bodies --------------------------------------------------------------


def test_a_body_is_required_exactly_where_the_document_says_so(env):
    for method, path in MINIMAL:
        required, _ = env.body_schema(method, path)
        r = env.send(method, path)
        if required:
            assert r.status_code == 400, (method, path, r.status_code)
            assert r.json()["error"]["message"] == "The request body is empty: send a JSON object."
        else:
            assert r.status_code != 400, (method, path, r.text)
    optional = {path for method, path in MINIMAL if not env.body_schema(method, path)[0]}
    assert optional == {"/admin/v1/keys/{key_id}/rotate"}


def _rotated_grace(response) -> float:
    assert response.status_code == 200, response.text
    until = datetime.fromisoformat(response.json()["previous_key_valid_until"])
    return (until - datetime.now(UTC)).total_seconds()


def test_rotate_without_a_body_keeps_the_old_secret_an_hour(env):
    rotate = "/admin/v1/keys/{key_id}/rotate"
    assert 3500 < _rotated_grace(env.send("post", rotate)) <= 3600
    assert 3500 < _rotated_grace(env.send("post", rotate, raw=b"null")) <= 3600
    assert 3500 < _rotated_grace(env.send("post", rotate, {})) <= 3600
    assert 0 < _rotated_grace(env.send("post", rotate, {"grace_seconds": 60})) <= 60
    for raw, param in [
        (b"{bad", None),
        (b"[]", "data"),
        (b'{"grace_seconds": "soon"}', "grace_seconds"),
        (b'{"grace_seconds": -1}', "grace_seconds"),
        (json.dumps({UNKNOWN: 1}).encode(), "data"),
    ]:
        r = env.send("post", rotate, raw=raw)
        assert r.status_code == 400, (raw, r.text)
        error = r.json()["error"]
        assert error["type"] == "invalid_request_error" and error["param"] == param, (raw, error)


# --- times in the usage query ------------------------------------------------------------------


def test_usage_times_are_documented(env):
    params = {p["name"]: p for p in env.doc["paths"]["/admin/v1/usage"]["get"]["parameters"]}
    for name in ("since", "until"):
        schema = params[name]["schema"]
        assert "oneOf" not in schema, schema
        kinds = {(s["type"], s.get("format")) for s in schema["anyOf"]}
        assert kinds == {("string", "date-time"), ("number", None)}
        number = next(s for s in schema["anyOf"] if s["type"] == "number")
        assert (number["minimum"], number["maximum"]) == (946684800, 4102444800)


@pytest.mark.parametrize(
    "value, expected",
    [
        ("2025-06-01T00:00:00Z", "2025-06-01T00:00:00Z"),
        ("2025-06-01T02:00:00+02:00", "2025-06-01T00:00:00Z"),
        ("1748736000", "2025-06-01T00:00:00Z"),
        ("1748736000.5", "2025-06-01T00:00:00.500000Z"),
    ],
)
def test_usage_takes_rfc3339_and_plausible_unix_seconds(env, value, expected):
    r = env.client.get("/admin/v1/usage", params={"until": value}, headers=env.admin)
    assert r.status_code == 200, r.text
    assert r.json()["until"] == expected


@pytest.mark.parametrize(
    "value, words",
    [
        ("0.5", "Unix seconds between 946684800 (2000) and 4102444800 (2100)"),
        ("-1", "RFC 3339"),
        ("1748736000000", "looks like Unix milliseconds"),
        ("2025-06-01", "with a UTC offset"),
        ("2025-06-01T00:00:00", "with a UTC offset"),
        ("2025-02-30T00:00:00Z", "RFC 3339"),
        ("1e9", "RFC 3339"),
        ("soon", "RFC 3339"),
    ],
)
def test_usage_refuses_other_times_naming_the_parameter(env, value, words):
    for param in ("since", "until"):
        r = env.client.get("/admin/v1/usage", params={param: value}, headers=env.admin)
        assert r.status_code == 400, (param, value, r.text)
        error = r.json()["error"]
        assert error["param"] == param and error["message"].startswith(param), error
        assert words in error["message"], error


def test_usage_since_must_come_before_until(env):
    now = datetime.now(UTC).replace(microsecond=0)
    since, until = (now - timedelta(hours=1)).isoformat(), now.isoformat()
    ok = env.client.get(
        "/admin/v1/usage", params={"since": since, "until": until}, headers=env.admin
    )
    assert ok.status_code == 200, ok.text
    bad = env.client.get(
        "/admin/v1/usage", params={"since": until, "until": since}, headers=env.admin
    )
    assert bad.status_code == 400


@pytest.mark.parametrize("value", [0.5, "0.5", 86400, "1999-12-31T23:59:59Z"])
def test_a_key_cannot_expire_before_2000(env, value):
    """The same slip in a body: `expires_at: 0.5` was a key that had expired in 1970."""
    for method, path in [("post", "/admin/v1/keys"), ("patch", "/admin/v1/keys/{key_id}")]:
        body = {"expires_at": value} | ({"name": "early"} if method == "post" else {})
        r = env.send(method, path, body)
        assert r.status_code == 400, (method, value, r.text)
        assert "expires_at must be an RFC 3339 date-time" in r.json()["error"]["message"]
