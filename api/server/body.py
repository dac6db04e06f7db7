"""JSON request bodies, checked before a route decodes them (a guard, after the auth one).

On the JSON routes (/v1, /tokenize, /detokenize, /admin/v1), a request with a body must say
`Content-Type: application/json` (415 otherwise, also when the header is missing: `curl -d`
sends application/x-www-form-urlencoded; the openai SDK sends application/json) and must be
well-formed JSON nested at most MAX_JSON_DEPTH levels (400 otherwise), with messages that
name the problem: empty, truncated, a lone surrogate escape, invalid UTF-8, too deep. So no
decoder failure (a RecursionError on deep nesting, say) can become a 500, and the routes'
typed decoding only ever sees bodies it can decode. Bodies over --max-body-size get 413 as
before. Checking a large body runs on the worker pool.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec

from api.server.errors import APIError, invalid_request
from api.usage.refusals import BODY_MODEL

MAX_JSON_DEPTH = 64  # arrays/objects inside each other; OpenAI bodies need a handful
_BODY_METHODS = {"POST", "PUT", "PATCH"}
_INLINE_BYTES = 64 * 1024  # larger bodies are checked on the worker pool

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))
_PAIR = re.compile(rb"\[\]|\{\}")
_HIGH = re.compile(rb"\\u[dD][89abAB][0-9a-fA-F]{2}")
_LOW = re.compile(rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def unsupported_media_type(content_type: str | None) -> APIError:
    got = f"got {content_type!r}" if content_type else "no Content-Type header was sent"
    return APIError(
        415,
        f"Request bodies must be JSON: send `Content-Type: application/json` ({got}).",
        "invalid_request_error",
        code="unsupported_media_type",
    )


def is_json_content_type(value: str | None) -> bool:
    if not value:
        return False
    media, _, params = value.partition(";")
    if media.strip().lower() != "application/json":
        return False
    charset = re.search(r"charset\s*=\s*\"?([\w-]+)", params, re.IGNORECASE)
    return charset is None or charset.group(1).lower() in ("utf-8", "utf8")


def json_too_deep(body: bytes, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether well-formed JSON `body` nests deeper than `limit`: strings dropped, only the
    brackets kept, then one pass per level removes every innermost pair (C-speed passes)."""
    brackets = _STRING.sub(b"", body).translate(None, _NOT_BRACKET)
    for _ in range(limit):
        if not brackets:
            return False
        brackets = _PAIR.sub(b"", brackets)
    return bool(brackets)


def _lone_surrogate(body: bytes) -> tuple[int, str] | None:
    """(byte offset, escape) of the first \\uD800-\\uDFFF escape that is not half of a pair."""
    pairs = set()
    for m in _HIGH.finditer(body):
        nxt = _LOW.match(body, m.end())
        if nxt is None:
            return m.start(), m.group().decode()
        pairs.add(nxt.start())
    for m in _LOW.finditer(body):
        if m.start() not in pairs:
            return m.start(), m.group().decode()
    return None


def check_json_body(body: bytes) -> Any:
    """Raise a 400 APIError with a clear message unless `body` is JSON the routes can take;
    the body's `model` field otherwise (None when there is none)."""
    if not body.strip():
        raise invalid_request("The request body is empty: send a JSON object.")
    try:
        value = msgspec.json.decode(body)
    except RecursionError:
        raise _too_deep() from None
    except msgspec.DecodeError as e:
        raise invalid_request(_decode_message(body, str(e))) from None
    if json_too_deep(body):
        raise _too_deep()
    return value.get("model") if isinstance(value, dict) else None


def _too_deep() -> APIError:
    return invalid_request(
        f"The JSON body is nested more than {MAX_JSON_DEPTH} levels deep (arrays and objects "
        "inside each other); flatten it."
    )


def _decode_message(body: bytes, detail: str) -> str:
    if "truncated" in detail or "surrogate" in detail:
        lone = _lone_surrogate(body)
        if lone is not None:
            at, escape = lone
            return (
                f"The request body holds a lone surrogate escape `{escape}` at byte {at}: JSON "
                "strings must be valid Unicode. Escape a character beyond U+FFFF as a "
                "surrogate pair (or send it as UTF-8), or drop it."
            )
    if "truncated" in detail:
        return (
            f"The request body is not complete JSON: it ends (at byte {len(body)}) before "
            "the value does. Was it cut short?"
        )
    if "UTF-8" in detail:
        return "The request body is not valid UTF-8: JSON must be sent as UTF-8 text."
    return f"The request body is not valid JSON: {detail}."


async def require_json_body(connection: Any, _handler: Any = None) -> None:
    """Guard: a body sent to a JSON route is JSON (415 / 400). Listed after the auth guard,
    so a bad key with a bad body is still 401, and the body is read (with Litestar's 413
    for an oversized one) only for a caller who may send it."""
    if connection.scope.get("method") not in _BODY_METHODS:
        return
    body = await connection.body()
    if not body:
        return  # the route says whether it needs one ("the request body is empty")
    content_type = connection.headers.get("content-type")
    if not is_json_content_type(content_type):
        raise unsupported_media_type(content_type)
    pool = connection.app.state.get("cpu_pool")
    if pool is not None and len(body) > _INLINE_BYTES:
        model = await pool.run(check_json_body, body)
    else:
        model = check_json_body(body)
    if isinstance(model, str):
        connection.state[BODY_MODEL] = model  # for a refusal's ledger row (api/usage/refusals.py)
