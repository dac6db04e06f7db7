"""Rendering console pages: a full page for a normal request, the page's partial for htmx.

The console keeps its own Jinja2 environment (templates/console/), so mounting it needs no
app-wide template config. Every response forbids caching and framing and carries a strict
Content-Security-Policy: scripts and styles only from /console/static, nothing inline.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from jinja2 import Environment, FileSystemLoader, StrictUndefined, select_autoescape
from litestar import Request, Response
from litestar.enums import MediaType


def _data_dir(name: str) -> Path:
    """templates/ or static/: inside this package when installed from a wheel (setup.py maps
    them there), else at the top of the source checkout (editable install, PYTHONPATH)."""
    here = Path(__file__).resolve().parent
    for path in (here / name, here.parent / name):
        if path.is_dir():
            return path
    raise RuntimeError(f"the console's {name}/ folder is missing from this installation")


TEMPLATE_DIR = _data_dir("templates") / "console"
STATIC_DIR = _data_dir("static")
STATIC_PATH = "/console/static"

SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "Vary": "HX-Request, Cookie",
    "X-Frame-Options": "DENY",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'"
    ),
}


def _duration(seconds: float) -> str:
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{seconds // 60:.0f} min {seconds % 60:.0f} s"
    return f"{seconds // 3600:.0f} h {seconds % 3600 // 60:.0f} min"


def _when(value: datetime | None) -> str:
    if value is None:
        return "—"
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M UTC")


def _number(value: float | int | None) -> str:
    if value is None:
        return "—"
    if isinstance(value, float) and not value.is_integer():
        return f"{value:,.1f}"
    return f"{int(value):,}"


def _rate(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:,.1f}"


def _environment() -> Environment:
    env = Environment(
        loader=FileSystemLoader(str(TEMPLATE_DIR)),
        autoescape=select_autoescape(["html"]),
        undefined=StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(duration=_duration, when=_when, number=_number, rate=_rate)
    env.globals.update(static=STATIC_PATH)
    return env


ENV = _environment()


def is_htmx(request: Request) -> bool:
    return request.headers.get("hx-request") == "true"


def html(template: str, context: dict[str, Any], status_code: int = 200) -> Response[str]:
    body = ENV.get_template(template).render(**context)
    return Response(
        body, status_code=status_code, media_type=MediaType.HTML, headers=SECURITY_HEADERS
    )


def page(
    request: Request,
    full: str,
    partial: str,
    context: dict[str, Any],
    *,
    status_code: int = 200,
) -> Response[str]:
    """The partial for htmx requests, else the full page (which includes the partial)."""
    session = request.state.get("console_session")
    ctx = {"csrf": session.csrf if session else "", "nav": full.removesuffix(".html"), **context}
    return html(partial if is_htmx(request) else full, ctx, status_code)
