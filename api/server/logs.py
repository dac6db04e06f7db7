"""Logging for `tessera serve`: text or JSON lines, each naming the request it is about.

    configure_logging(level="info", fmt="text" | "json", stream=sys.stderr)

Every record gets `request_id` and `tenant` from api/server/request_context.py (None outside a
request) by a filter on the root handler, so uvicorn's access log, the app's and the
libraries' lines all carry them. Text lines end in `[request_id=...]` when there is one;
JSON lines are objects with ts (RFC 3339, UTC), level, logger, msg, request_id, tenant, and
exc (the traceback) when there is one, plus any `extra={...}` fields given to the log call.
Lines the engine's own thread writes are not about one HTTP request and carry no id.
"""

from __future__ import annotations

import json
import logging
import sys
from datetime import UTC, datetime
from typing import Any, TextIO

from api.server.request_context import current_request_id, current_tenant

LOG_FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(request_suffix)s"
# LogRecord's own attributes: everything else on a record came from `extra=`.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "request_suffix",
                                                    "request_id", "tenant", "color_message"}  # fmt: skip


class RequestContextFilter(logging.Filter):
    def __init__(self, server: str | None = None) -> None:
        super().__init__()
        self.server = server  # which process of several (--api-server-count): api-0, core, ...

    def filter(self, record: logging.LogRecord) -> bool:
        if self.server is not None:
            record.server = self.server
        if not hasattr(record, "request_id"):
            record.request_id = current_request_id()
        if not hasattr(record, "tenant"):
            record.tenant = current_tenant()
        rid = record.request_id
        record.request_suffix = f" [request_id={rid}]" if rid else ""
        return True


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        body: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
            "tenant": getattr(record, "tenant", None),
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in body:
                body[key] = value if isinstance(value, str | int | float | bool) else str(value)
        if record.exc_info:
            body["exc"] = self.formatException(record.exc_info)
        return json.dumps(body, ensure_ascii=False)


def configure_logging(
    level: str = "info", fmt: str = "text", stream: TextIO | None = None, server: str | None = None
) -> None:
    """One handler on the root logger (replacing any), uvicorn's loggers propagating to it.
    `server`: the process's name among the server's (--api-server-count), on every line."""
    if fmt not in LOG_FORMATS:
        raise ValueError(f"log format must be one of {', '.join(LOG_FORMATS)}, got {fmt!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.addFilter(RequestContextFilter(server))
    text = (
        TEXT_FORMAT
        if server is None
        else TEXT_FORMAT.replace(" %(name)s", " [%(server)s] %(name)s")
    )
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(text))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True


__all__ = ["LOG_FORMATS", "JsonFormatter", "RequestContextFilter", "configure_logging"]
