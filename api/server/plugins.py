"""Route handlers that installed packages add to the server, such as the admin console.

    handlers = installed_routers()        # [console's Router, ...]
    app = create_app(settings, extra_route_handlers=handlers)

A package adds routes with an entry point in the `tessera.routers` group naming a function
that returns a Litestar router (pyproject.toml: `console = "console:create_console_router"`).
The server finds them by group, never by name: api/ imports nothing from console/, and a
deployment that leaves the console out (or adds its own pages) changes no server code.
"""

from __future__ import annotations

import logging
from importlib.metadata import entry_points
from typing import Any

ROUTERS_GROUP = "tessera.routers"
logger = logging.getLogger("tessera.api")


def installed_routers(group: str = ROUTERS_GROUP) -> list[Any]:
    """One router per entry point of `group`, in name order; one that fails to load is an
    error (a console that silently vanished would be worse)."""
    routers = []
    for ep in sorted(entry_points(group=group), key=lambda ep: ep.name):
        factory = ep.load()
        routers.append(factory())
        logger.debug("Mounted %s from %s", ep.name, ep.value)
    return routers
