"""The console's router: every page under /console, guarded by the session hook, plus the
vendored static files (public: the login page needs them).

    app = create_app(settings, extra_route_handlers=[create_console_router()])

No app-wide configuration is needed: the console renders its own templates and checks its
own sessions and CSRF tokens. What it reads from app.state is listed in console/state.py.
"""

from __future__ import annotations

from litestar import Router
from litestar.datastructures import CacheControlHeader
from litestar.static_files import create_static_files_router

from console.adapters import AdaptersController
from console.auth import LoginController, LogoutController, require_session
from console.dashboard import DashboardController
from console.keys import KeysController
from console.render import STATIC_DIR
from console.requests import RequestsController
from console.settings_page import SettingsController
from console.tenants import TenantsController
from console.usage import UsageController


def create_console_router(path: str = "/console") -> Router:
    static = create_static_files_router(
        path="/static",
        directories=[STATIC_DIR],
        opt={"public": True},
        cache_control=CacheControlHeader(max_age=3600),
        include_in_schema=False,
        name="console-static",
    )
    return Router(
        path=path,
        route_handlers=[
            LoginController,
            LogoutController,
            DashboardController,
            RequestsController,
            KeysController,
            TenantsController,
            UsageController,
            AdaptersController,
            SettingsController,
            static,
        ],
        before_request=require_session,
        include_in_schema=False,
    )
