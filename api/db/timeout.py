"""A database service with a deadline on every call (--db-timeout), for the admin REST API
and the console: a locked table or a hung database answers 503 after the timeout instead of
holding the request (and its connection) until the lock goes away, however long that is.

    keys = TimedService(KeyService(db), timeout=5.0)
    await keys.list()          # TimeoutError after 5 s: api/admin/common.py and the app's
                               # handler turn it into 503 service_unavailable

The API's own lookups (key cache, quotas, ledger) have their own deadlines.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from typing import Any


class TimedService:
    """Proxies `service`; each coroutine method it returns runs under asyncio.timeout."""

    def __init__(self, service: Any, timeout: float) -> None:
        self._service = service
        self._timeout = timeout

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._service, name)
        if not inspect.iscoroutinefunction(attr):
            return attr
        timeout = self._timeout

        @functools.wraps(attr)
        async def timed(*args: Any, **kwargs: Any) -> Any:
            async with asyncio.timeout(timeout):
                return await attr(*args, **kwargs)

        return timed
