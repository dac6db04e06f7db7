"""The settings page: the engine configuration as served, and the server's settings, read-only.

Secrets never reach the page: the admin and metrics tokens and API keys show as set / a count,
and the database URL loses its password.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from litestar import Controller, Request, Response, get

from console.render import page
from console.state import engine_of, settings_of

SECRET_FIELDS = {"admin_token", "metrics_token"}


def _sections(config: Any) -> list[tuple[str, list[tuple[str, Any]]]]:
    """An EngineConfig (dataclasses all the way down) -> [(section, [(field, value)])]."""
    top: list[tuple[str, Any]] = []
    sections = []
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value):
            sections.append((f.name, [(k, v) for k, v in dataclasses.asdict(value).items()]))
        else:
            top.append((f.name, value))
    return [("engine", top), *sections] if top else sections


def _server_settings(settings: Any) -> list[tuple[str, Any]]:
    if settings is None or not dataclasses.is_dataclass(settings):
        return []
    from api.db.session import redact

    rows = []
    for f in dataclasses.fields(settings):
        value = getattr(settings, f.name)
        if f.name in SECRET_FIELDS:
            value = "set" if value else "not set"
        elif f.name == "api_key":
            value = f"{len(value)} static key(s)"
        elif f.name == "database_url" and value:
            value = redact(value)
        rows.append((f.name, value))
    return rows


class SettingsController(Controller):
    path = "/settings"

    @get("/")
    async def settings(self, request: Request) -> Response:
        engine = engine_of(request.app)
        runtime: list[tuple[str, Any]] = []
        sections: list[tuple[str, list[tuple[str, Any]]]] = []
        if engine is not None:
            stats = engine.stats()
            runtime = [
                ("served model name", engine.model_name),
                ("max_model_len (effective)", engine.max_model_len),
                ("KV-cache blocks", stats.num_blocks),
                ("block size (tokens)", stats.block_size),
                ("KV-cache capacity (tokens)", max(stats.num_blocks - 1, 0) * stats.block_size),
            ]
            sections = _sections(engine.config)
        context = {
            "runtime": runtime,
            "sections": sections,
            "server": _server_settings(settings_of(request.app)),
            "loading": engine is None,
        }
        return page(request, "settings.html", "_settings.html", context)
