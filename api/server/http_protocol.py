"""uvicorn's HTTP protocols (httptools, h11) with the two guards they lack: a header-read deadline and a cap on
open connections (slowloris and idle-connection floods).

uvicorn times out an idle keep-alive connection only after a first response; a connection
that never finishes its request line and headers is held forever, so a client dribbling
bytes can hold file descriptors without limit. Here every connection must complete its
request headers within `header_read_timeout` seconds of connecting (or of its previous
response), and a connection beyond `max_connections` is answered at once with a 503 in the
OpenAI error envelope (with Retry-After) and closed, before a byte of it is read. Both are
read from the uvicorn Config (set by api/cli/main.py `serve`). uvicorn's own limit_concurrency is
left off: its 503 is plain text.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

_OVER_CAP_BODY = json.dumps(
    {
        "error": {
            "message": "The server has too many open connections; retry shortly.",
            "type": "service_unavailable",
            "param": None,
            "code": "too_many_connections",
        }
    }
).encode()
OVER_CAP_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
    b"retry-after: 1\r\nconnection: close\r\n"
    b"content-length: " + str(len(_OVER_CAP_BODY)).encode() + b"\r\n\r\n" + _OVER_CAP_BODY
)


class _Guards:
    """Mixed into a uvicorn protocol class (which provides cycle, connections, transport)."""

    cycle: Any
    connections: Any
    transport: Any
    loop: Any

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        self._header_timeout: float | None = getattr(config, "header_read_timeout", None)
        self._max_connections: int | None = getattr(config, "max_connections", None)
        self._header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self._max_connections and len(self.connections) > self._max_connections:
            transport.write(OVER_CAP_RESPONSE)  # over the cap: refuse before reading a byte
            transport.close()
            return
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm()  # the next request's headers get the same deadline

    def _arm(self) -> None:
        self._disarm()
        if self._header_timeout:
            self._header_timer = self.loop.call_later(self._header_timeout, self._deadline)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _deadline(self) -> None:
        """Close unless a request's headers arrived (its cycle runs, or is running)."""
        self._header_timer = None
        cycle = self.cycle
        if (cycle is None or cycle.response_complete) and not self.transport.is_closing():
            self.transport.close()


class GuardedH11Protocol(_Guards, H11Protocol):
    pass


def guarded_protocol() -> type:
    """httptools' parser where it is installed (less CPU per request), else h11."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return GuardedH11Protocol
    return type("GuardedHttpToolsProtocol", (_Guards, HttpToolsProtocol), {})
