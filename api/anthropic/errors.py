"""Errors in Anthropic's shape, on the Anthropic routes only (the OpenAI routes keep theirs):

    {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}

The status codes are the server's own (api/server/error_map.py maps every exception to an
APIError once); the type follows the status as Anthropic's API does. Retry-After and the
x-ratelimit-* headers go out unchanged.
"""

from __future__ import annotations

from typing import Any

from api.server.error_map import error_handlers
from api.server.errors import APIError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "request_too_large",
    415: "invalid_request_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    504: "api_error",
}


def error_type(status: int) -> str:
    if status in ERROR_TYPES:
        return ERROR_TYPES[status]
    return "invalid_request_error" if status < 500 else "api_error"


def error_body(err: APIError) -> dict[str, Any]:
    return {"type": "error", "error": {"type": error_type(err.status_code), "message": err.message}}


EXCEPTION_HANDLERS = error_handlers(error_body)

# The OpenAPI component of the error body (api/server/openapi.py documents the Anthropic
# routes' error statuses with it).
ERROR_SCHEMA = "AnthropicErrorResponse"
ERROR_COMPONENT: dict[str, Any] = {
    "type": "object",
    "description": "The Anthropic error body.",
    "required": ["type", "error"],
    "properties": {
        "type": {"type": "string", "enum": ["error"]},
        "error": {
            "type": "object",
            "required": ["type", "message"],
            "properties": {
                "type": {"type": "string", "enum": sorted(set(ERROR_TYPES.values()))},
                "message": {"type": "string"},
            },
        },
    },
}
