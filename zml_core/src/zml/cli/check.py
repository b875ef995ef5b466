"""``zml policy check``: every problem in a ``zml.toml``, not only the first.

Loading a configuration stops at its first error (a client must not start on a bad file). A
check is different: the user wants the whole list to fix in one pass. So each part of the file
is validated on its own, with the same code and the same messages as loading: each unknown
table, each ``[accelerators.NAME]``, each ``[[nodes]]`` entry (against the families that are
valid), duplicate node ids, each ``[policies.NAME]`` against the valid part of the fleet, then
the ``[gateway]`` table as ``zml serve`` validates it (so that "ok" here means the gateway
starts on the file too).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from zml.config import ConfigFile, Registry, read_config_file, registry_from_mapping
from zml.errors import PolicyConfigError, ZMLError

__all__ = ["config_problems"]


def config_problems(path: str | os.PathLike[str]) -> list[str]:
    """Every problem found in the configuration file at ``path`` (empty: the file is valid)."""
    source = str(path)
    try:
        data = read_config_file(path)
    except PolicyConfigError as exc:
        return [str(exc)]
    if not data:
        return [f"{source} is empty: define at least one [accelerators.NAME] family and its "
                "[[nodes]] (`zml demo --dir .` writes an example)"]
    problems: list[str] = []
    for key in data:
        if key not in ConfigFile.model_fields:
            problems.append(_problem({key: data[key]}, source))
    families = _families(data.get("accelerators"), source, problems)
    nodes = _nodes(data.get("nodes"), families, source, problems)
    if not families and not problems:
        problems.append(f"{source} defines no accelerator family: add [accelerators.NAME]")
    registry = Registry(families, tuple(nodes), {}, source)
    policies = data.get("policies", {})
    if isinstance(policies, Mapping):
        from zml.policy import policy_from_mapping

        for name, table in policies.items():
            try:
                policy_from_mapping(table, registry, table=str(name))
            except ZMLError as exc:
                problems.append(str(exc))
    elif "policies" in data:
        problems.append(_problem({"policies": policies}, source))
    if "gateway" in data:
        problems += _gateway(data["gateway"], source)
    return problems


def _gateway(table: object, source: str) -> list[str]:
    if not isinstance(table, Mapping):
        return [_problem({"gateway": table}, source)]
    from zml.gateway.settings import gateway_settings

    try:
        gateway_settings(Registry(source=source, gateway=table))
    except ZMLError as exc:
        return [str(exc)]
    return []


def _problem(data: Mapping[str, Any], source: str) -> str:
    try:
        registry_from_mapping(data, source=source)
    except PolicyConfigError as exc:
        return str(exc)
    return f"{source}: invalid configuration"  # pragma: no cover - the caller knows it fails


def _families(tables: object, source: str, problems: list[str]) -> dict[str, Any]:
    if tables is None:
        return {}
    if not isinstance(tables, Mapping):
        problems.append(_problem({"accelerators": tables}, source))
        return {}
    valid: dict[str, Any] = {}
    for name, table in tables.items():
        try:
            valid.update(registry_from_mapping({"accelerators": {name: table}},
                                               source=source).families)
        except PolicyConfigError as exc:
            problems.append(str(exc))
    return valid


def _nodes(entries: object, families: Mapping[str, Any], source: str,
           problems: list[str]) -> list[Any]:
    if entries is None:
        return []
    if not isinstance(entries, list):
        problems.append(_problem({"nodes": entries}, source))
        return []
    valid: list[Any] = []
    seen: dict[str, int] = {}
    raw_families: dict[str, dict[str, Any]] = {name: {} for name in families}
    for i, entry in enumerate(entries):
        try:
            (node,) = registry_from_mapping({"accelerators": raw_families, "nodes": [entry]},
                                            source=source).nodes
        except PolicyConfigError as exc:
            text = str(exc).removeprefix(f"{source}: ")
            text = (text.replace("nodes[0]", f"nodes[{i}]", 1) if "nodes[0]" in text
                    else f"nodes[{i}]: {text}")
            problems.append(f"{source}: {text}")
            continue
        if node.id in seen:
            problems.append(f"{source}: nodes[{i}].id {node.id!r} is a duplicate of "
                            f"nodes[{seen[node.id]}].id; node ids must be unique")
            continue
        seen[node.id] = i
        valid.append(node)
    return valid
