"""``zml-policy-sqlite``: create the database; add, update, list, show and remove its policies.

Every write is validated first, against the fleet registry a zml client would build from the
same configuration (``--config PATH``, else ``$ZML_CONFIG``, else ``./zml.toml``, plus any
fleet-source plugins): a policy with an unknown family or a bad field is refused with zml's
``PolicyConfigError`` message, and nothing is written. So are a number that is not finite
(``inf``, ``nan``: JSON cannot hold it) and ``--unset`` of a field ``zml.Policy`` does not have.
Only ``add`` and ``init`` create the database file: the other commands refuse a path where no
file exists (a mistyped ``--db``) with one line naming it, and create nothing.
Exit status: 0 done, 1 refused or failed, 2 bad command line.

Examples::

    zml-policy-sqlite init --db policies.db          # an empty database (optional)
    zml-policy-sqlite add llama3-production --db policies.db --config zml.toml \\
        --chain H100,MI300X --latency-target-ms 500 --cost-priority balanced
    zml-policy-sqlite update llama3-production --db policies.db --cost-priority cost
    zml-policy-sqlite list --db policies.db
    zml-policy-sqlite rm llama3-production --db policies.db
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sqlite3
import sys
from collections.abc import Sequence
from typing import Any

import zml
from zml.cli.policy_args import add_policy_arguments, policy_fields
from zml.config import suggest

from .store import ENV_DB, PolicyStore, StoreError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--db",
        default=os.environ.get(ENV_DB) or None,
        help=f"the SQLite database (default: ${ENV_DB}); only add and init create it",
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
    sub.add_parser(
        "init", parents=[common],
        help="create an empty database (add creates it too); nothing to do if it exists",
    )
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


def _check_finite(fields: dict[str, Any]) -> None:
    """Refuse a NaN or infinite number anywhere in ``fields`` (``zml.PolicyConfigError``).

    The table is read as JSON by other tools too, and JSON has neither.
    """
    stack: list[tuple[str, object]] = list(fields.items())
    while stack:
        where, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            raise zml.PolicyConfigError(
                f"{where} = {value!r}: numbers must be finite (JSON has no NaN or infinity); "
                "give a finite value or leave the field out",
                field=where,
                value=value,
            )
        if isinstance(value, dict):
            stack += [(f"{where}.{k}", v) for k, v in value.items()]
        elif isinstance(value, list):
            stack += [(f"{where}[{i}]", v) for i, v in enumerate(value)]


def _check_unset(names: Sequence[str], given: dict[str, Any]) -> None:
    """Refuse ``--unset`` of a field ``zml.Policy`` lacks, or of one also given a value."""
    fields = [f for f in zml.Policy.model_fields if f != "name"]
    for name in names:
        if name in given:
            raise zml.PolicyConfigError(
                f"--unset {name}: the command line also gives {name} a value; drop one of them",
                field="--unset",
                value=name,
            )
        if name not in fields:
            hint = suggest(name, fields)
            raise zml.PolicyConfigError(
                f"--unset {name!r}: not a Policy field"
                + (f"; did you mean {hint!r}?" if hint else f" (fields: {', '.join(fields)})"),
                field="--unset",
                value=name,
                suggestion=hint,
            )


def _describe(name: str, fields: dict[str, Any]) -> str:
    chain = ",".join(fields.get("accelerator_chain", []))
    rest = " ".join(f"{k}={v}" for k, v in sorted(fields.items()) if k != "accelerator_chain")
    return f"{name}\t{chain}\t{rest}".rstrip()


def _created(store: PolicyStore) -> str:
    return " (a new database: the file did not exist)" if store.created else ""


def _init(args: argparse.Namespace) -> int:
    with PolicyStore(args.db) as store:
        if store.created:
            print(f"created the policy database {args.db}")
        else:
            good, bad = store.scan()
            count = len(good) + len(bad)
            print(f"the policy database {args.db} exists already "
                  f"({count} {'policy' if count == 1 else 'policies'}); nothing to do")
    return 0


def _add(args: argparse.Namespace) -> int:
    given = policy_fields(args)
    _check_finite(given)
    fields = validate(args.name, given, args.config)  # before the file is opened, or created
    with PolicyStore(args.db) as store:
        store.add(args.name, fields)
        print(f"added policy {args.name!r} to {args.db}{_created(store)}")
    return 0


def _update(store: PolicyStore, args: argparse.Namespace) -> int:
    given = policy_fields(args)
    _check_unset(args.unset, given)
    current = store.get(args.name)
    if current is None:
        raise StoreError(f"no policy {args.name!r} in {args.db}; use 'add'", value=args.name)
    merged = {**current, **given}
    for field in args.unset:
        merged.pop(field, None)
    _check_finite(merged)
    store.put(args.name, validate(args.name, merged, args.config))
    print(f"updated policy {args.name!r} in {args.db}")
    return 0


def _list(store: PolicyStore, args: argparse.Namespace) -> int:
    """Print the policies that are readable; report each row that is not, on stderr (exit 1)."""
    good, bad = store.scan()
    if args.as_json:
        print(json.dumps(dict(good), indent=2))
    else:
        for name, fields in good:
            print(_describe(name, fields))
    for exc in bad:
        _error(exc)
    return 1 if bad else 0


def _show(store: PolicyStore, args: argparse.Namespace) -> int:
    found = store.get(args.name)
    if found is None:
        raise StoreError(f"no policy {args.name!r} in {args.db}", value=args.name)
    print(json.dumps({"name": args.name, **found}, indent=2))
    return 0


def _rm(store: PolicyStore, args: argparse.Namespace) -> int:
    store.remove(args.name)
    print(f"removed policy {args.name!r} from {args.db}")
    return 0


_CREATING = {"init": _init, "add": _add}
"""The commands that create the database file when it is missing (they open it themselves)."""
_COMMANDS = {"update": _update, "list": _list, "show": _show, "rm": _rm}
"""The commands that need an existing file (a missing one is refused: nothing is created)."""


def _error(message: object) -> None:
    print(f"zml-policy-sqlite: error: {message}", file=sys.stderr)


def run(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status (errors are one line each on stderr)."""
    parser = _parser()
    args = parser.parse_args(argv)
    if not args.db:
        parser.error(f"pass --db PATH or set {ENV_DB}")
    try:
        creating = _CREATING.get(args.command)
        if creating is not None:
            return creating(args)
        with PolicyStore(args.db, create=False) as store:
            return _COMMANDS[args.command](store, args)
    except (zml.PolicyConfigError, ValueError) as exc:
        _error(exc)
    except (OSError, sqlite3.Error) as exc:  # the database failed mid-command (locked...)
        _error(f"the policy database {args.db!r}: {type(exc).__name__}: {exc}")
    return 1


def main() -> None:
    """The console script's entry point."""
    sys.exit(run())
