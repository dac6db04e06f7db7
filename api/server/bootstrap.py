"""First start: the admin token and the first API key, printed once so that `make serve`
followed by the OpenAI SDK works in one step.

The admin token is `--admin-token` / TESSERA_ADMIN_TOKEN when given. Otherwise it is
generated on first start and written, in plaintext, to `<data dir>/admin_token` (mode 0600,
created exclusively so two processes starting together agree on one token); later starts
read it back. A file rather than a digest in the database because the console signs its
session cookies with the token, so the server needs the secret itself; whoever can read the
file could also read the database, which is why the file is private to its owner.
Replicas sharing a Postgres database should all be given the same --admin-token.

The first API key comes from KeyService.ensure_bootstrap (only when the key table is
empty); its plaintext exists only in this process's memory and in the banner.
"""

from __future__ import annotations

import errno
import logging
import os
import secrets
import sys
from pathlib import Path
from typing import TextIO

log = logging.getLogger("tessera.api")

ADMIN_TOKEN_FILE = "admin_token"
ADMIN_TOKEN_PREFIX = "tsa-"


def load_or_create_admin_token(data_dir: Path) -> tuple[str, bool]:
    """(token, created): the token kept in data_dir, creating it on first use."""
    path = data_dir / ADMIN_TOKEN_FILE
    data_dir.mkdir(parents=True, exist_ok=True)
    token = ADMIN_TOKEN_PREFIX + secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        if exc.errno != errno.EEXIST:
            raise
        return _read_token(path), False
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token, True


def _read_token(path: Path) -> str:
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        log.warning("%s is readable by other users (mode %o); chmod 600 it", path, mode)
    token = path.read_text().strip()
    if not token:
        raise RuntimeError(f"{path} is empty: delete it to generate a new admin token")
    return token


def print_banner(
    *,
    base_url: str,
    api_key: str | None,
    admin_token: str | None,
    admin_token_file: Path | None,
    out: TextIO | None = None,
) -> None:
    """The one time these secrets are shown. print(), not the logger: logs never hold keys."""
    if api_key is None and admin_token is None:
        return
    out = out or sys.stdout
    rule = "=" * 78
    lines = [rule, "Tessera: first start. Store these now; they are not shown again.", ""]
    if api_key is not None:
        lines += [
            f"  API key:     {api_key}",
            "  Use it with the OpenAI SDK:",
            f"    export OPENAI_BASE_URL={base_url}/v1",
            f"    export OPENAI_API_KEY={api_key}",
            "",
        ]
    if admin_token is not None:
        lines += [
            f"  Admin token: {admin_token}",
            f"    (kept in {admin_token_file}, mode 0600) for the admin API under "
            f"{base_url}/admin/v1",
            f"    and the console at {base_url}/console",
            "",
        ]
    lines.append(rule)
    print("\n".join(lines), file=out, flush=True)


def warn_open_server(out: TextIO | None = None) -> None:
    """--auth none: say so loudly, where a person starting the server looks."""
    out = out or sys.stderr
    rule = "!" * 78
    message = (
        "WARNING: --auth none: this server accepts every request without an API key, with\n"
        "no quotas and no usage accounting per key. Use it only for local development."
    )
    print(f"{rule}\n{message}\n{rule}", file=out, flush=True)
    log.warning("Authentication is disabled (--auth none)")


# 32 characters of token_urlsafe carry 192 bits; a generated admin token has 43 (256 bits).
MIN_SECRET_LEN = 32
GOOD_SECRET_HINT = 'python -c "import secrets; print(secrets.token_urlsafe(32))"'


def warn_short_secrets(admin_token: str | None, metrics_token: str | None = None) -> None:
    """A WARNING for an --admin-token or --metrics-token shorter than MIN_SECRET_LEN (never
    refused: tests and trials use short ones). Logs the length, never the secret."""
    for flag, secret in (("--admin-token", admin_token), ("--metrics-token", metrics_token)):
        if secret and len(secret) < MIN_SECRET_LEN:
            log.warning(
                "%s is only %d characters long: a short token can be guessed (failed attempts "
                "are throttled per client address, not across addresses). Use at least %d "
                "random characters, e.g. from `%s`",
                flag,
                len(secret),
                MIN_SECRET_LEN,
                GOOD_SECRET_HINT,
            )
