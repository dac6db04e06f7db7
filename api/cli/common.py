"""What the `tessera keys`, `tenants` and `db` commands share: the database options, argument
types, running a command against the database (exit status 0 ok, 1 failure, 2 bad input) and
printing a table."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Awaitable, Callable
from datetime import datetime
from typing import TextIO

from sqlalchemy.exc import SQLAlchemyError

from api.db.session import Database, SchemaOutOfDate, redact, resolve_database_url
from api.keys.service import KeyNotFound, KeyRecord
from api.tenants.service import TenantNotFound


def database_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--database-url",
        default=None,
        help="sqlite+aiosqlite:///PATH or postgresql+asyncpg://USER:PASS@HOST/DB "
        "[env TESSERA_DATABASE_URL; default SQLite in the data dir]",
    )
    parser.add_argument(
        "--data-dir",
        default=None,
        help="folder of the default SQLite database [env TESSERA_DATA_DIR; "
        "default ~/.local/share/tessera]",
    )


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number of at least 1, got {value}")
    return value


def seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


class Failed(Exception):
    """A command failed for a reason already explained to the user."""


def run_with_database(
    args: argparse.Namespace,
    body: Callable[[Database, TextIO], Awaitable[None]],
    out: TextIO | None,
) -> int:
    stream = out or sys.stdout
    try:
        db = Database.from_url(resolve_database_url(args.database_url, args.data_dir))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    async def main() -> None:
        try:
            await body(db, stream)
        finally:
            await db.dispose()

    try:
        asyncio.run(main())
    except (ValueError, KeyNotFound, TenantNotFound) as exc:
        print(f"error: {exc.args[0] if exc.args else exc}", file=sys.stderr)
        return 2
    except SchemaOutOfDate as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Failed as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except (OSError, TimeoutError) as exc:
        print(f"error: cannot reach the database {redact(db.url)}: {exc}", file=sys.stderr)
        return 1
    except SQLAlchemyError as exc:
        cause = getattr(exc, "orig", None) or exc
        print(f"error: database {redact(db.url)}: {cause}", file=sys.stderr)
        return 1
    return 0


def limits(r: KeyRecord) -> str:
    parts = [
        f"{label}={value}"
        for label, value in (
            ("rpm", r.rpm_limit),
            ("tpm", r.tpm_limit),
            ("parallel", r.max_parallel),
            (f"budget/{r.budget_period}", r.token_budget),
        )
        if value is not None
    ]
    return " ".join(parts) or "unlimited"


def when(value: datetime | None) -> str:
    return value.strftime("%Y-%m-%d %H:%M") if value else "-"


def print_table(rows: list[tuple[str, ...]], out: TextIO) -> None:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print(
            "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip(), file=out
        )
