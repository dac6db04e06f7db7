"""OPTIONS answers whose Allow header lists every method a path serves.

Litestar 2 builds a path's automatic OPTIONS handler when the path's first handler is
registered, and that handler's Allow lists the methods of the route as it was then. A
controller registers its handlers one at a time, so OPTIONS /admin/v1/keys said
`OPTIONS, POST` although GET is served there too (litestar#4169; fixed in Litestar 3).
`fix_options_handlers` runs at start-up, once every route is in place, and gives each
automatic OPTIONS handler its route's full method set. 405 answers already list them.
"""

from __future__ import annotations

from typing import Any

from litestar import Response
from litestar.enums import MediaType
from litestar.routes import HTTPRoute
from litestar.status_codes import HTTP_204_NO_CONTENT

_LITESTARS = "litestar.routes.http"  # where the automatic handler's function is defined


def allowed_methods(route: HTTPRoute) -> str:
    return ", ".join(sorted(route.methods))


def fix_options_handlers(app: Any) -> None:
    for route in app.routes:
        if not isinstance(route, HTTPRoute) or "OPTIONS" not in route.route_handler_map:
            continue
        handler = route.route_handler_map["OPTIONS"][0]
        automatic = getattr(handler.fn, "__module__", None) == _LITESTARS
        if automatic or hasattr(handler.fn, "allow"):  # never a route's own OPTIONS handler
            handler._fn = _options_handler(allowed_methods(route))


def _options_handler(allow: str) -> Any:
    # The same signature as Litestar's (its parameters were parsed from that function).
    def options_handler(scope: Any) -> Response:
        return Response(
            content=None,
            status_code=HTTP_204_NO_CONTENT,
            headers={"Allow": allow},
            media_type=MediaType.TEXT,
        )

    options_handler.allow = allow  # type: ignore[attr-defined]
    return options_handler
