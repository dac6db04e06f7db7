"""`tessera tenants ...`: tenants (teams of keys) on the command line.

    tessera tenants create NAME [--weight W] [--rpm N] [--tpm N] [--max-parallel N]
                               [--token-budget N] [--budget-period day|month|total]
                               [--prefix-cache-scope key|tenant] [--max-request-seconds S]
                               [--json]
    tessera tenants list [--active] [--json]
    tessera tenants update ID [--name NAME] [--weight W] [--rpm N|none] [--tpm N|none]
                              [--max-parallel N|none] [--token-budget N|none]
                              [--budget-period P] [--prefix-cache-scope S]
                              [--max-request-seconds S|none] [--enable] [--json]
    tessera tenants delete ID [ID ...]        # disables: its keys are refused (401)

Keys join a tenant with `tessera keys create NAME --tenant ID`. Same --database-url /
--data-dir as `tessera keys` (api/cli/db.py), same exit codes (0 ok, 1 failure, 2 bad input).
"""

from __future__ import annotations

import argparse
from typing import Any, TextIO

from api.admin.schemas import tenant_info
from api.cli.common import (
    database_options,
    for_each_id,
    limit_options,
    limits,
    max_request_seconds_option,
    print_json,
    print_listing,
    run_service,
    when,
)
from api.keys.fields import PREFIX_CACHE_SCOPES, TENANT_FIELDS
from api.tenants.service import TenantRecord, TenantService


def _weight(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not 0 < value <= 1000:
        raise argparse.ArgumentTypeError("the weight must be above 0 and at most 1000")
    return value


def _setting_options(parser: argparse.ArgumentParser, *, update: bool) -> None:
    # On update an option left out changes nothing (SUPPRESS); "none" lifts a limit.
    default = argparse.SUPPRESS if update else None
    parser.add_argument("--weight", type=_weight, default=default if update else 1.0,
                        help="share of the fair scheduler (default 1)")  # fmt: skip
    limit_options(parser, update=update, described=False)
    parser.add_argument(
        "--prefix-cache-scope",
        choices=PREFIX_CACHE_SCOPES,
        default=default if update else "key",
        help="key: each key's prompts cached apart (default); tenant: shared by its keys",
    )
    max_request_seconds_option(parser, update=update, described=False)
    parser.add_argument("--json", action="store_true", help="print the tenant as JSON")


def add_tenants_parser(subparsers: Any) -> argparse.ArgumentParser:
    tenants = subparsers.add_parser("tenants", help="create, list, update and delete tenants")
    actions = tenants.add_subparsers(dest="tenants_command", metavar="{create,list,update,delete}")
    actions.required = True

    create = actions.add_parser("create", help="add a tenant")
    create.add_argument("name")
    _setting_options(create, update=False)

    listing = actions.add_parser("list", help="list tenants")
    listing.add_argument("--active", action="store_true", help="hide disabled tenants")
    listing.add_argument("--json", action="store_true", help="print JSON")

    update = actions.add_parser("update", help="change a tenant ('none' lifts a limit)")
    update.add_argument("id", metavar="ID")
    update.add_argument("--name", default=argparse.SUPPRESS)
    update.add_argument(
        "--enable", dest="disabled", action="store_false", default=argparse.SUPPRESS,
        help="re-enable a disabled tenant",
    )  # fmt: skip
    _setting_options(update, update=True)

    delete = actions.add_parser("delete", help="disable tenants (their keys stop working)")
    delete.add_argument("ids", nargs="+", metavar="ID")

    for sub in (create, listing, update, delete):
        database_options(sub)
    tenants.set_defaults(handler=run_tenants, func=run_tenants)
    return tenants


def run_tenants(args: argparse.Namespace, out: TextIO | None = None) -> int:
    actions = {"create": _create, "list": _list, "update": _update, "delete": _delete}
    return run_service(args, TenantService, actions[args.tenants_command], out)


def _show(record: TenantRecord, as_json: bool, out: TextIO, verb: str) -> None:
    if as_json:
        print_json(tenant_info(record), out)
    else:
        print(f"{verb} tenant {record.name!r} (id {record.id}).", file=out)


async def _create(tenants: TenantService, args: argparse.Namespace, out: TextIO) -> None:
    record = await tenants.create(args.name, **{f: getattr(args, f) for f in TENANT_FIELDS})
    _show(record, args.json, out, "Created")


async def _update(tenants: TenantService, args: argparse.Namespace, out: TextIO) -> None:
    changes = {
        f: getattr(args, f) for f in (*TENANT_FIELDS, "name", "disabled") if hasattr(args, f)
    }
    if not changes:
        raise ValueError("nothing to change: pass at least one option (see --help)")
    _show(await tenants.update(args.id, **changes), args.json, out, "Updated")


async def _delete(tenants: TenantService, args: argparse.Namespace, out: TextIO) -> None:
    await for_each_id(args.ids, tenants.disable, "Disabled", out)


async def _list(tenants: TenantService, args: argparse.Namespace, out: TextIO) -> None:
    print_listing(
        await tenants.list(include_disabled=not args.active),
        args.json,
        out,
        info=tenant_info,
        empty="No tenants. Create one with `tessera tenants create NAME`.",
        header=("ID", "NAME", "WEIGHT", "KEYS", "CACHE", "DISABLED", "LIMITS"),
        row=lambda r: (
            r.id,
            r.name,
            f"{r.weight:g}",
            str(r.keys),
            r.prefix_cache_scope,
            when(r.disabled_at),
            limits(r),
        ),  # fmt: skip
    )
