"""``zml-policy-sqlite``: add, update, list, show and remove policies in the database.

Every write is validated first, against the fleet registry a zml client would build from the
same configuration (``--config PATH``, else ``$ZML_CONFIG``, else ``./zml.toml``, plus any
fleet-source plugins): a policy with an unknown family or a bad field is refused with zml's
``PolicyConfigError`` message, and nothing is written. Exit status: 0 done, 1 refused or
failed, 2 bad command line.

Examples::

    zml-policy-sqlite add llama3-production --db policies.db --config zml.toml \\
        --chain H100,MI300X --latency-target-ms 500 --cost-priority balanced
    zml-policy-sqlite update llama3-production --db policies.db --cost-priority cost
    zml-policy-sqlite list --db policies.db
    zml-policy-sqlite rm llama3-production --db policies.db
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
from collections.abc import Sequence
from typing import Any

import zml
from zml.cli.policy_args import add_policy_arguments, policy_fields

from .store import ENV_DB, PolicyStore, StoreError

__all__ = ["main"]

def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--db",
        default=os.environ.get(ENV_DB) or None,
        help=f"the SQLite database (default: ${ENV_DB})",
    )
    fields = argparse.ArgumentParser(add_help=False)
    fields.add_argument("--config", help="zml.toml to validate against (default: discovered)")
    add_policy_arguments(fields)

    parser = argparse.ArgumentParser(
        prog="zml-policy-sqlite",
        description="Manage zml routing policies stored in SQLite; running clients with "
        f"{ENV_DB} set see changes on their next request.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    add = sub.add_parser("add", parents=[common, fields], help="add a new policy")
    add.add_argument("name")
    update = sub.add_parser(
        "update", parents=[common, fields], help="change fields of an existing policy"
    )
    update.add_argument("name")
    update.add_argument(
        "--unset", action="append", default=[], metavar="FIELD",
        help="reset a field to its default (repeatable)",
    )
    ls = sub.add_parser("list", parents=[common], help="list the stored policies")
    ls.add_argument("--json", dest="as_json", action="store_true", help="print JSON")
    show = sub.add_parser("show", parents=[common], help="print one policy as JSON")
    show.add_argument("name")
    rm = sub.add_parser("rm", parents=[common], help="remove a policy")
    rm.add_argument("name")
    return parser


def validate(name: str, fields: dict[str, Any], config: str | None) -> dict[str, Any]:
    """Validate ``fields`` as policy ``name`` against the fleet registry of ``config``.

    Returns the fields to store (the ones given, normalised); raises ``zml.PolicyConfigError``.
    """
    with zml.Client(config=config) as client:
        policy = client.policy({**fields, "name": name})
    stored: dict[str, Any] = policy.model_dump(mode="json", exclude_unset=True)
    stored.pop("name", None)
    return stored


def _describe(name: str, fields: dict[str, Any]) -> str:
    chain = ",".join(fields.get("accelerator_chain", []))
    rest = " ".join(f"{k}={v}" for k, v in sorted(fields.items()) if k != "accelerator_chain")
    return f"{name}\t{chain}\t{rest}".rstrip()


def run(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.db:
        parser.error(f"pass --db PATH or set {ENV_DB}")
    try:
        with PolicyStore(args.db) as store:
            if args.command == "add":
                fields = validate(args.name, policy_fields(args), args.config)
                store.add(args.name, fields)
                print(f"added policy {args.name!r} to {args.db}")
            elif args.command == "update":
                current = store.get(args.name)
                if current is None:
                    raise StoreError(f"no policy {args.name!r} in {args.db}; use 'add'")
                merged = {**current, **policy_fields(args)}
                for field in args.unset:
                    merged.pop(field, None)
                store.put(args.name, validate(args.name, merged, args.config))
                print(f"updated policy {args.name!r} in {args.db}")
            elif args.command == "list":
                items = store.items()
                if args.as_json:
                    print(json.dumps({name: fields for name, fields in items}, indent=2))
                else:
                    for name, fields in items:
                        print(_describe(name, fields))
            elif args.command == "show":
                found = store.get(args.name)
                if found is None:
                    raise StoreError(f"no policy {args.name!r} in {args.db}")
                print(json.dumps({"name": args.name, **found}, indent=2))
            else:
                store.remove(args.name)
                print(f"removed policy {args.name!r} from {args.db}")
    except (zml.PolicyConfigError, StoreError, ValueError, OSError, sqlite3.Error) as exc:
        print(f"zml-policy-sqlite: error: {exc}", file=sys.stderr)
        return 1
    return 0


def main() -> None:
    """The console script's entry point."""
    sys.exit(run())
