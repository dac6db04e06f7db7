"""The HTTP error contract: every error leaves as the OpenAI envelope.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

Routes, guards and services raise APIError (or one of the helpers below); the app's
exception handlers turn it, Litestar's own errors and anything unexpected into the envelope.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class APIError(Exception):
    status_code: int
    message: str
    type: str = "invalid_request_error"
    code: str | None = None
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def to_body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def __str__(self) -> str:
        return f"{self.status_code} {self.type}: {self.message}"

    def __reduce__(self) -> tuple:
        # Raised in a worker process (api/server/offload.py) and re-raised here: an exception
        # pickles as cls(*args), and a dataclass's fields are not its args.
        fields = (self.status_code, self.message, self.type, self.code, self.param, self.headers)
        return (type(self), fields)


def invalid_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, "invalid_request_error", code=code, param=param)


def invalid_api_key(message: str = "Incorrect or missing API key.") -> APIError:
    return APIError(401, message, "invalid_request_error", code="invalid_api_key")


def permission_denied(message: str) -> APIError:
    return APIError(403, message, "permission_denied", code="permission_denied")


def model_not_found(model: str) -> APIError:
    return APIError(
        404,
        f"The model `{model}` does not exist or you do not have access to it.",
        "invalid_request_error",
        code="model_not_found",
        param="model",
    )


def rate_limited(
    message: str, retry_after: float, headers: dict[str, str] | None = None
) -> APIError:
    h = {"Retry-After": str(max(1, int(retry_after + 0.999)))}
    h.update(headers or {})
    return APIError(429, message, "rate_limit_exceeded", code="rate_limit_exceeded", headers=h)


def insufficient_quota(message: str, headers: dict[str, str] | None = None) -> APIError:
    h = {"x-should-retry": "false"}
    h.update(headers or {})
    return APIError(429, message, "insufficient_quota", code="insufficient_quota", headers=h)


# A request the engine ended at its deadline (--request-timeout or the key's limit): 504, as
# a gateway whose upstream ran out of time answers (408 would blame the client's upload).
TIMEOUT_STATUS = 504


def request_timed_out(
    message: str = "The request ran past its time limit and was stopped; ask for fewer tokens "
    "or retry later.",
) -> APIError:
    return APIError(TIMEOUT_STATUS, message, "timeout", code="request_timeout")


def unavailable(message: str, retry_after: int = 1) -> APIError:
    return APIError(
        503,
        message,
        "service_unavailable",
        code="service_unavailable",
        headers={"Retry-After": str(retry_after)},
    )
