"""The OpenAPI document as the wire is, and the /docs page without a CDN.

`document_errors` rewrites the generated document once at start-up: every operation lists
each error status its route can return (400/401/403/404/409/413/415/429/503, as applicable)
with the error body the server actually sends (the OpenAI envelope; Anthropic's on
/v1/messages), in place of Litestar's default
400 body; /health documents its 503. `document_request_bodies` marks the bodies that refuse
unknown fields (`additionalProperties: false`), as the server does. `OfflineSwagger` serves
Swagger UI from the vendored files of the `swagger-ui-bundle` package (Apache-2.0) under
/docs/static, with a page that has no inline script, behind a Content-Security-Policy that
allows only this origin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import msgspec.inspect
from litestar import Response, get
from litestar.datastructures import ResponseHeader
from litestar.enums import MediaType
from litestar.openapi.plugins import OpenAPIRenderPlugin
from litestar.params import FromPath

from api.anthropic.errors import ERROR_COMPONENT as ANTHROPIC_ERROR_COMPONENT
from api.anthropic.errors import ERROR_SCHEMA as ANTHROPIC_ERROR_SCHEMA
from api.openai.request_fields import documented_fields
from api.openai.responses.translate import REFUSED_FIELDS as REFUSED_RESPONSE_FIELDS
from api.server.allow import fix_options_handlers

ERROR_SCHEMA = "ErrorResponse"
_REF = {"$ref": f"#/components/schemas/{ERROR_SCHEMA}"}
_NULLABLE_STRING = {"oneOf": [{"type": "string"}, {"type": "null"}]}
_ERROR_COMPONENT = {
    "type": "object",
    "description": "The OpenAI error envelope.",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": _NULLABLE_STRING,
                "code": _NULLABLE_STRING,
            },
        }
    },
}
_DESCRIPTIONS = {
    400: "Invalid request: a bad parameter (`param` names it) or a malformed JSON body.",
    401: "Missing, unknown, revoked or expired key.",
    403: "The key may not use this model.",
    404: "Unknown model or resource.",
    409: "The LoRA adapter is in use by requests in flight: unload it once they finished.",
    413: "Body larger than --max-body-size.",
    415: "Body not sent as application/json.",
    429: "Over a rate limit or the token budget (Retry-After, x-ratelimit-*).",
    503: "Queue full, loading, draining, engine down or database unavailable (Retry-After).",
}
_GENERATION = {
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/embeddings",
    "/v1/responses",
}
_TOKENIZER = {"/tokenize", "/detokenize", "/v1/messages/count_tokens"}
# Routes whose errors are Anthropic's body, not the OpenAI envelope (api/anthropic/errors.py).
_ANTHROPIC = {"/v1/messages", "/v1/messages/count_tokens"}
_OPEN = {"/health", "/version"}
# The LoRA adapter routes (api/admin/lora.py): 404 without --enable-lora or for an unknown
# adapter; the unloads 409 while requests run the adapter.
_LORA = {"/admin/v1/lora_adapters", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"}
_LORA_UNLOAD = {"/v1/unload_lora_adapter", "/admin/v1/lora_adapters/{name}"}


def error_statuses(path: str, operation: dict[str, Any]) -> set[int]:
    """The error statuses one operation of the API can answer with."""
    if path in _OPEN:
        return {400} if operation.get("parameters") else set()
    out = {401, 503}
    if "requestBody" in operation:
        out |= {400, 413, 415}
    if operation.get("parameters"):
        out.add(400)
    if "{" in path:
        out.add(404)
    if path in _GENERATION or path in _TOKENIZER:
        out |= {400, 403, 404}
    if path in _GENERATION:
        out.add(429)
    if path in _LORA or path in _LORA_UNLOAD:
        out.add(404)
    if path in _LORA_UNLOAD:
        out.add(409)
    return out


def document_errors(schema: dict[str, Any]) -> dict[str, Any]:
    """Rewrite the rendered document (a dict, in place): see the module docstring."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    components[ERROR_SCHEMA] = _ERROR_COMPONENT
    components[ANTHROPIC_ERROR_SCHEMA] = ANTHROPIC_ERROR_COMPONENT
    anthropic_ref = {"$ref": f"#/components/schemas/{ANTHROPIC_ERROR_SCHEMA}"}
    for path, item in schema.get("paths", {}).items():
        for method, operation in item.items():
            if not isinstance(operation, dict) or "responses" not in operation:
                continue
            responses = operation["responses"]
            ref = anthropic_ref if path in _ANTHROPIC else _REF
            for status in sorted(error_statuses(path, operation)):
                responses[str(status)] = {
                    "description": _DESCRIPTIONS[status],
                    "content": {"application/json": {"schema": ref}},
                }
            if path == "/health" and "200" in responses and method == "get":
                responses["503"] = {**responses["200"], "description": _DESCRIPTIONS[503]}
    return schema


# --- /docs -----------------------------------------------------------------------------------

DOCS_CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; font-src 'self'; base-uri 'none'; "
    "form-action 'none'; frame-ancestors 'none'"
)
_STATIC = {
    "swagger-ui.css": "text/css",
    "swagger-ui-bundle.js": "application/javascript",
    "favicon-32x32.png": "image/png",
}
_PAGE = b"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Tessera API</title>
<link rel="icon" href="/docs/static/favicon-32x32.png">
<link rel="stylesheet" href="/docs/static/swagger-ui.css"></head>
<body><div id="swagger-ui"></div>
<script src="/docs/static/swagger-ui-bundle.js"></script>
<script src="/docs/static/init.js"></script></body></html>
"""
_INIT_JS = b"""window.ui = SwaggerUIBundle({
  url: "/docs/openapi.json", dom_id: "#swagger-ui", deepLinking: true,
  presets: [SwaggerUIBundle.presets.apis],
});
"""


def _swagger_dir() -> Path:
    import swagger_ui_bundle

    return Path(swagger_ui_bundle.swagger_ui_path)


@get("/static/{name:str}", include_in_schema=False, sync_to_thread=False, cache=3600)
def _docs_static(name: FromPath[str]) -> Response[bytes]:
    if name == "init.js":
        return Response(_INIT_JS, media_type="application/javascript")
    media = _STATIC.get(name)
    if media is None:
        return Response(b"not found", status_code=404, media_type=MediaType.TEXT)
    return Response((_swagger_dir() / name).read_bytes(), media_type=media)


class OfflineSwagger(OpenAPIRenderPlugin):
    """Swagger UI at /docs from vendored files; its assets at /docs/static/*."""

    def __init__(self) -> None:
        super().__init__(path="/")

    def render(self, request: Any, openapi_schema: dict[str, Any]) -> bytes:
        return _PAGE

    def receive_router(self, router: Any) -> None:
        router.register(_docs_static)
        csp = ResponseHeader(name="Content-Security-Policy", value=DOCS_CSP)
        router.response_headers = [*(router.response_headers or ()), csp]


# --- request bodies: unknown fields ---------------------------------------------------------

# The routes whose top-level fields api/openai/request_fields.py polices, and its name for each.
_POLICED = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/embeddings": "embedding",
}


def document_request_bodies(schema: dict[str, Any], app: Any, *, lenient: bool) -> None:
    """Make the request bodies say what the server does with fields they do not list.

    - msgspec Structs with forbid_unknown_fields (the admin bodies) refuse unknown fields:
      `additionalProperties: false` (Litestar's generator leaves it out);
    - chat and completions refuse unknown top-level fields (api/openai/request_fields.py) unless
      --lenient-request-fields: `additionalProperties: false` then, and always the fields
      the policy accepts without effect or only with a value that changes nothing, each
      with its schema and why."""
    components = schema.get("components", {}).get("schemas", {})
    for struct in _forbidding_structs(app):
        names = {f.encode_name for f in struct.fields}
        for component in components.values():
            props = component.get("properties", {})
            if component.get("title") == struct.cls.__name__ and set(props) <= names:
                component["additionalProperties"] = False
    for path, endpoint in _POLICED.items():
        component = _body_component(schema, path)
        if component is None:
            continue
        props = component.setdefault("properties", {})
        for name, field_schema in documented_fields(endpoint).items():
            props.setdefault(name, field_schema)
        if lenient:
            component.pop("additionalProperties", None)
        else:
            component["additionalProperties"] = False
    component = _body_component(schema, "/v1/responses")
    if component is not None:  # fields refused unless harmless: only the harmless values
        for name, field_schema in REFUSED_RESPONSE_FIELDS.items():
            component.setdefault("properties", {})[name] = {
                **field_schema,
                "description": "Refused unless its value asks for nothing (not supported).",
            }


def _body_component(schema: dict[str, Any], path: str) -> dict[str, Any] | None:
    try:
        body = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        name = body["schema"]["$ref"].rsplit("/", 1)[1]
        return schema["components"]["schemas"][name]
    except (KeyError, AttributeError, IndexError):
        return None


def _forbidding_structs(app: Any) -> list[msgspec.inspect.StructType]:
    """The msgspec Structs, in any route's body or nested in one, that refuse unknown fields."""
    found: dict[type, msgspec.inspect.StructType] = {}
    seen: set[type] = set()  # a recursive Struct is walked once

    def walk(node: Any) -> None:
        if isinstance(node, msgspec.inspect.StructType):
            if node.cls in seen:
                return
            seen.add(node.cls)
            if node.forbid_unknown_fields:
                found[node.cls] = node
            for f in node.fields:
                walk(f.type)
        elif isinstance(node, msgspec.inspect.Type):
            for value in msgspec.structs.asdict(node).values():
                for item in value if isinstance(value, tuple) else (value,):
                    if isinstance(item, msgspec.inspect.Type):
                        walk(item)

    for route in app.routes:
        for handler in getattr(route, "route_handlers", ()):
            data = handler.parsed_fn_signature.parameters.get("data")
            if data is None:
                continue
            try:
                walk(msgspec.inspect.type_info(data.annotation))
            except (TypeError, ValueError):  # a body type msgspec does not describe
                continue
    return list(found.values())


def document_errors_at_startup(app: Any) -> None:
    """on_startup, before the first request renders the document: make what the server says
    about itself agree with what it does. The document gets the error envelope
    (document_errors) and the request bodies' rules for unknown fields
    (document_request_bodies, per --lenient-request-fields); OPTIONS answers get every
    method of their path (api/server/allow.py)."""
    from litestar._openapi.plugin import OpenAPIPlugin  # its cached dict is what is served

    plugin = app.plugins.get(OpenAPIPlugin)
    schema = plugin.provide_openapi_schema()
    document_errors(schema)
    server = app.state.get("server")
    lenient = bool(getattr(getattr(server, "settings", None), "lenient_request_fields", False))
    document_request_bodies(schema, app, lenient=lenient)
    fix_options_handlers(app)
