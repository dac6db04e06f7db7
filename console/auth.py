"""Console login, logout, and the hook that guards every other console route.

Everything under /console needs a session, except the login page and the static files
(routes with opt["public"]). Without one, a page request gets 302 to the login page and an
htmx request gets 401 with HX-Redirect (a redirect would swap the login page into a panel).
Every unsafe request must carry the session's CSRF token, as the form field `_csrf` or the
X-CSRF-Token header (htmx sends the header, set once on <body>).

Wrong admin tokens are throttled per client address (api/server/login_throttle.py, shared with the
admin API): after --login-max-failures within --login-failure-window the login page answers
429 with Retry-After, and the token is not even checked until the lockout ends.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import quote

from litestar import Controller, Request, Response, get, post
from litestar.datastructures import Cookie
from litestar.params import FromQuery
from litestar.response import Redirect

from api.server.login_throttle import client_address, retry_after
from console.render import html, is_htmx
from console.session import (
    CSRF_FIELD,
    CSRF_HEADER,
    LOGIN_COOKIE,
    LOGIN_TTL_S,
    SESSION_COOKIE,
    SESSION_TTL_S,
)
from console.state import console_state, login_throttle_of, settings_of

LOGIN_PATH = "/console/login"
SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})


def _signer(request: Request) -> Any:
    settings = settings_of(request.app)
    return console_state(request.app).signer(getattr(settings, "admin_token", None))


def _secure(request: Request) -> bool:
    return request.url.scheme == "https"


def _cookie(request: Request, key: str, value: str, max_age: int, path: str) -> Cookie:
    return Cookie(
        key=key,
        value=value,
        max_age=max_age,
        path=path,
        httponly=True,
        samesite="strict",
        secure=_secure(request),
    )


def _next_path(value: str | None) -> str:
    """Only a console path may be the target after login (no open redirect)."""
    ok = bool(value) and value.startswith("/console") and "\\" not in value
    return value if ok and not value.startswith(LOGIN_PATH) else "/console"


def _forbidden(request: Request, message: str) -> Response:
    if is_htmx(request):
        return Response(message, status_code=403, media_type="text/plain")
    return html("error.html", {"message": message, "csrf": "", "nav": ""}, 403)


async def require_session(request: Request) -> Response | None:
    """before_request hook of the console router: None lets the request through."""
    if request.route_handler.opt.get("public"):
        return None
    signer = _signer(request)
    session = signer.verify(request.cookies.get(SESSION_COOKIE)) if signer else None
    if session is not None and session in console_state(request.app).revocations:
        session = None
    if session is None:
        if is_htmx(request):
            return Response(
                "Login required.",
                status_code=401,
                media_type="text/plain",
                headers={"HX-Redirect": LOGIN_PATH},
            )
        target = request.url.path
        if request.url.query:
            target += "?" + request.url.query
        return Redirect(f"{LOGIN_PATH}?next={quote(target, safe='/')}", status_code=302)
    request.state.console_session = session
    if request.method not in SAFE_METHODS:
        given = request.headers.get(CSRF_HEADER)
        if given is None:
            given = (await request.form()).get(CSRF_FIELD)
        if not signer.same(session.csrf, given):
            return _forbidden(request, "The form's security token is missing or stale: reload.")
    return None


class LoginController(Controller):
    path = "/"
    opt = {"public": True}

    @get("/login", sync_to_thread=False)
    def login_page(self, request: Request, next: FromQuery[str | None] = None) -> Response:
        return self._form(request, _next_path(next), error=None, status_code=200)

    def _form(self, request: Request, next_path: str, error: str | None, status_code: int):
        signer = _signer(request)
        context = {"error": error, "next": next_path, "enabled": signer is not None}
        context.update(csrf="", nav="login", login_csrf="")
        cookies = []
        if signer is not None:
            nonce = signer.login_nonce()
            context["login_csrf"] = signer.login_csrf(nonce)
            cookies.append(_cookie(request, LOGIN_COOKIE, nonce, LOGIN_TTL_S, LOGIN_PATH))
        response = html("login.html", context, status_code)
        response.cookies.extend(cookies)
        return response

    def _locked_out(self, request: Request, next_path: str, seconds: float) -> Response:
        wait = retry_after(seconds)
        message = (
            f"Too many failed attempts from your address: try again in {wait} seconds. "
            "Until then no token is accepted, not even the right one."
        )
        response = self._form(request, next_path, message, 429)
        response.headers["Retry-After"] = wait
        return response

    @post("/login", status_code=302)
    async def login(self, request: Request) -> Response:
        form = await request.form()
        next_path = _next_path(form.get("next"))
        signer = _signer(request)
        if signer is None:
            return self._form(request, next_path, "The console is disabled.", 403)
        throttle, client = login_throttle_of(request.app), client_address(request)
        wait = throttle.locked_for(client)
        if wait > 0:  # before the token is looked at: a right guess now is no use either
            return self._locked_out(request, next_path, wait)
        nonce = request.cookies.get(LOGIN_COOKIE, "")
        if not nonce or not signer.same(signer.login_csrf(nonce), form.get(CSRF_FIELD)):
            return self._form(request, next_path, "The login form expired; try again.", 403)
        if not signer.token_matches(str(form.get("token") or "")):
            throttle.failure(client, "console")
            return self._form(request, next_path, "That is not the admin token.", 401)
        throttle.success(client)
        cookie, _session = signer.issue()
        response = Redirect(next_path, status_code=302)
        response.cookies.append(_cookie(request, SESSION_COOKIE, cookie, SESSION_TTL_S, "/console"))
        response.cookies.append(_cookie(request, LOGIN_COOKIE, "", 0, LOGIN_PATH))
        return response


class LogoutController(Controller):
    path = "/"

    @post("/logout", status_code=302)
    async def logout(self, request: Request) -> Response:
        session = request.state.get("console_session")
        if session is not None:
            console_state(request.app).revocations.revoke(session)
        response = Redirect(LOGIN_PATH, status_code=302)
        response.cookies.append(_cookie(request, SESSION_COOKIE, "", 0, "/console"))
        return response
