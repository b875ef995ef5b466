"""``zml policies push|list|show|rm``: the policy store in Redis, from the ``zml`` command.

Every push is validated first, against the fleet registry a zml client would build from the
same configuration (``--config PATH``, else ``$ZML_CONFIG``, else ``./zml.toml``, plus any
fleet-source plugins): a policy with an unknown family or a bad field is refused with zml's
``PolicyConfigError`` (printed by ``zml`` as one line, exit status 2) and **nothing** is
written, not even the valid policies of the same file. A URL redis-py cannot use (``--redis``
or ``$ZML_REDIS_URL``) exits with status 2; other failures (Redis unreachable, an unreadable or
non-UTF-8 file, a missing policy, a store key edited by hand into something ``push`` never
writes) exit with status 1. Every failure is one line, without the URL's password.

Examples::

    zml policies push policies.toml --redis redis://127.0.0.1:6379/0 --config zml.toml
    zml policies push --name fast --chain H100,MI300X --latency-target-ms 300
    zml policies list --json
    zml policies rm fast
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

import zml
from zml.cli.policy_args import add_policy_arguments, policy_fields

from .settings import ENV_PREFIX, ENV_URL, SettingsError, check_url, redact, scrub

if TYPE_CHECKING:
    from zml.config import Registry

__all__ = ["add_commands", "load_policy_file", "run", "validate"]

class CommandError(Exception):
    """A failure reported as ``zml policies: error: ...`` with exit status 1."""


def add_commands(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``policies`` and its subcommands to the ``zml`` command."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--redis", metavar="URL",
                        help=f"the Redis holding the policies (default: ${ENV_URL})")
    common.add_argument("--prefix",
                        help=f"key prefix of the store (default: ${ENV_PREFIX}, else 'zml')")

    policies = subparsers.add_parser(
        "policies", help="routing policies kept in Redis, live in every client (zml-redis)",
        description="Manage routing policies kept in Redis. Clients with ZML_REDIS_URL set "
        "switch to a pushed policy within a second, without a restart.",
    )
    sub = policies.add_subparsers(dest="policies_command", required=True, metavar="SUBCOMMAND")

    push = sub.add_parser(
        "push", parents=[common],
        help="validate and write policies (a TOML/JSON file of tables, or --name and fields)",
        description="Validate policies against the fleet registry, then write them all "
        "(each replaces the stored policy of that name). FILE is TOML or JSON: tables of "
        "Policy fields by name, at the top level or under 'policies' (a zml.toml works).",
    )
    push.add_argument("file", nargs="?", help="a .toml or .json file of policy tables")
    push.add_argument("--config", help="zml.toml to validate against (default: discovered)")
    push.add_argument("--name", help="push one policy with the fields given as flags")
    add_policy_arguments(push)

    ls = sub.add_parser("list", parents=[common], help="list the stored policies")
    ls.add_argument("--json", dest="as_json", action="store_true", help="print JSON")
    show = sub.add_parser("show", parents=[common], help="print one policy as JSON")
    show.add_argument("name")
    rm = sub.add_parser("rm", parents=[common], help="remove policies (all or none)")
    rm.add_argument("names", nargs="+", metavar="NAME")
    policies.set_defaults(handler=run)


# --- reading and validating ------------------------------------------------------------------------


def load_policy_file(path: str | os.PathLike[str]) -> dict[str, dict[str, Any]]:
    """Policy tables by name from a TOML or JSON file (at the top level or under
    ``policies``, as in a ``zml.toml``)."""
    file = Path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except OSError as exc:
        raise CommandError(f"cannot read {str(file)!r}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise CommandError(f"{file}: not UTF-8 text (byte {exc.start}): save it as UTF-8"
                           ) from None
    data: Any
    try:
        if file.suffix.lower() == ".json":
            data = json.loads(text)
        elif file.suffix.lower() == ".toml":
            data = tomllib.loads(text)
        else:
            try:
                data = json.loads(text)
            except json.JSONDecodeError:
                data = tomllib.loads(text)
    except (json.JSONDecodeError, tomllib.TOMLDecodeError) as exc:
        raise CommandError(f"{file}: not valid TOML or JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CommandError(f"{file}: expected tables of policies by name")
    if isinstance(data.get("policies"), dict):
        data = data["policies"]
    tables: dict[str, dict[str, Any]] = {}
    for name, fields in data.items():
        if not isinstance(fields, dict):
            raise zml.PolicyConfigError(
                f"{file}: policy {name!r} must be a table of Policy fields, got "
                f"{type(fields).__name__}",
                field=name, value=fields, source=str(file),
            )
        tables[name] = fields
    if not tables:
        raise CommandError(f"{file}: no policy tables found")
    return tables


def registry_for(config: str | None) -> Registry:
    """The fleet registry a client would build: ``config`` (or the discovered zml.toml) plus
    the fleet-source plugins."""
    from zml.config import EMPTY_REGISTRY, discover_path, load_registry
    from zml.plugins.fleet_sources import build_registry
    from zml.plugins.manager import client_manager

    path = discover_path(config)
    file_config = load_registry(path) if path is not None else EMPTY_REGISTRY
    return build_registry(client_manager(), file_config)


def validate(
    tables: Mapping[str, Mapping[str, Any]], registry: Registry, where: str | None = None
) -> dict[str, dict[str, Any]]:
    """Validate every policy against ``registry``; return the fields to store (as given,
    normalised, without ``name``). Raises ``zml.PolicyConfigError`` at the first bad one."""
    from zml.policy import policy_from_mapping

    stored: dict[str, dict[str, Any]] = {}
    for name, fields in tables.items():
        try:
            policy = policy_from_mapping({**fields, "name": name}, registry)
        except zml.PolicyConfigError as exc:
            if where is None:
                raise
            raise zml.PolicyConfigError(
                f"{where}: {exc}", field=exc.field, value=exc.value,
                suggestion=exc.suggestion, source=where,
            ) from None
        fields_out: dict[str, Any] = policy.model_dump(mode="json", exclude_unset=True)
        fields_out.pop("name", None)
        stored[name] = fields_out
    return stored


def _describe(name: str, version: int, fields: Mapping[str, Any]) -> str:
    chain = ",".join(fields.get("accelerator_chain", []))
    rest = " ".join(f"{k}={v}" for k, v in sorted(fields.items()) if k != "accelerator_chain")
    return f"{name}\tv{version}\t{chain}\t{rest}".rstrip()


# --- the handler ---------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> int:
    """Run ``zml policies ...``; return the exit status (PolicyConfigError propagates)."""
    import redis

    from .policies import PolicyStore, StoreError

    url = args.redis or os.environ.get(ENV_URL, "").strip()
    if not url:
        print(f"zml policies: error: pass --redis URL or set {ENV_URL}", file=sys.stderr)
        return 2
    prefix = args.prefix or os.environ.get(ENV_PREFIX, "").strip() or "zml"
    try:
        check_url(url, "--redis" if args.redis else ENV_URL)
    except SettingsError as exc:
        print(f"zml policies: error: {exc}", file=sys.stderr)
        return 2
    where = redact(url)
    try:
        if args.policies_command == "push":
            stored = _validated_push(args)  # before connecting: nothing is written if invalid
            with PolicyStore(url, prefix) as store:
                version, versions = store.push(stored)
            for name, v in versions.items():
                print(f"pushed policy {name!r} (version {v}) to {where}")
            print(f"store version {version}")
            return 0
        with PolicyStore(url, prefix) as store:
            if args.policies_command == "rm":
                version, versions = store.remove(args.names)
                for name in versions:
                    print(f"removed policy {name!r} from {where}")
                print(f"store version {version}")
                return 0
            snapshot = store.snapshot()
        if args.policies_command == "show":
            fields = snapshot.policies.get(args.name)
            if fields is None:
                raise CommandError(f"no policy {args.name!r} in {where}")
            print(json.dumps({"name": args.name, "version": snapshot.versions[args.name],
                              **fields}, indent=2))
        elif args.as_json:
            print(json.dumps({
                "version": snapshot.version,
                "policies": {name: {"version": snapshot.versions[name], "fields": fields}
                             for name, fields in sorted(snapshot.policies.items())},
            }, indent=2))
        else:
            print(f"# {where} prefix={prefix!r} store version {snapshot.version}")
            for name in sorted([*snapshot.policies, *snapshot.invalid]):
                fields = snapshot.policies.get(name)
                if fields is None:
                    print(f"{name}\tv{snapshot.versions[name]}\t(not a JSON object: push it "
                          "again)")
                else:
                    print(_describe(name, snapshot.versions[name], fields))
        return 0
    except (CommandError, StoreError) as exc:
        print(f"zml policies: error: {exc}", file=sys.stderr)
    except redis.RedisError as exc:
        print(f"zml policies: error: Redis at {where}: {type(exc).__name__}: "
              f"{scrub(str(exc), url)}", file=sys.stderr)
    return 1


def _validated_push(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    flags = policy_fields(args)
    if args.file is not None:
        if args.name is not None or flags:
            raise CommandError("pass a FILE of policies, or --name with fields, not both")
        tables = load_policy_file(args.file)
        where: str | None = args.file
    else:
        if args.name is None:
            raise CommandError("pass a FILE of policies, or --name NAME with --chain ...")
        tables = {args.name: flags}
        where = None
    return validate(tables, registry_for(args.config), where)
