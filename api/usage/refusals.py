"""Ledger rows for generation requests refused before they had a ticket.

A request to /v1/chat/completions, /v1/completions or /v1/messages that an authenticated
key sent but that ended in an error before admission (a 400 for a bad parameter, 403, 404,
413, 415) still gets its usage row: the status the client got, no tokens, no finish reason.
From admission on (api/openai/serving.py `open_ticket`), the accountant writes the row
itself, 429s and 503s included, so every request has exactly one.
"""

from __future__ import annotations

import uuid
from typing import Any

LEDGER_OWNED = "tessera_ledger_owned"  # request.state: the accountant writes this row
BODY_MODEL = "tessera_body_model"  # request.state: the body's `model`, when it had one
_ROUTES = {"/v1/chat/completions": "chatcmpl", "/v1/completions": "cmpl", "/v1/messages": "msg"}


def record_refusal(request: Any, status: int) -> None:
    """Write the refused request's row, if it is a generation request of a known key."""
    try:
        prefix = _ROUTES.get(request.scope.get("path", ""))
        if prefix is None or request.method != "POST" or status < 400:
            return
        state = request.state
        if state.get(LEDGER_OWNED):
            return
        principal = state.get("principal")
        key_id = getattr(principal, "key_id", None)
        accountant = request.app.state.get("accountant")
        if key_id is None or accountant is None:
            return  # 401 (nobody to bill), or no ledger
        state[LEDGER_OWNED] = True
        model = state.get(BODY_MODEL) or ""
        accountant.refused(principal, f"{prefix}-{uuid.uuid4().hex}", str(model)[:255], status)
    except Exception:  # noqa: BLE001 - an error response must go out whatever happens here
        return
