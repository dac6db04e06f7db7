"""The htmx + Jinja2 admin console: live dashboard, requests, keys, usage, settings."""

from __future__ import annotations

from console.router import create_console_router

__all__ = ["create_console_router"]
