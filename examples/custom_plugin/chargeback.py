"""Two zml plugins in one module: a policy source and a telemetry plugin.

* :class:`JsonPolicies` keeps named policies in a JSON file. Its ``version()`` is the file's
  modification time, so editing the file changes the policies of running clients.
* :class:`Chargeback` adds up what each team spent, from the ``metadata={"team": ...}`` that
  callers pass to ``infer`` and the cost zml attributes to each response; it also counts
  failed attempts per node.

Register them in code (``client.plugins.register(...)``, see run.py) or ship them in a package
with an entry point of group ``zml`` (see docs/plugins.md).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import zml
from zml.plugins import PolicySource


class JsonPolicies:
    """A policy source: ``{"name": {Policy fields...}, ...}`` in a JSON file."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.name = f"json:{self.path.name}"

    def _read(self) -> dict[str, Any]:
        data = json.loads(self.path.read_text())
        return data if isinstance(data, dict) else {}

    def get(self, name: str) -> Mapping[str, Any] | None:
        return self._read().get(name)

    def list(self) -> list[str]:
        return list(self._read())

    def version(self) -> int:
        return self.path.stat().st_mtime_ns


class JsonPolicyPlugin:
    """The plugin that registers a :class:`JsonPolicies` source."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.source = JsonPolicies(path)

    @zml.hookimpl
    def zml_register_policy_sources(self, register: Callable[[PolicySource], None]) -> None:
        register(self.source)


class Chargeback:
    """A telemetry plugin: cost per team, failed attempts per node."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.requests: dict[str, int] = defaultdict(int)
        self.failed_attempts: dict[str, int] = defaultdict(int)

    @zml.hookimpl
    def zml_request_completed(
        self, cost: zml.Cost | None, metadata: Mapping[str, Any]
    ) -> None:
        team = str(metadata.get("team", "unattributed"))
        self.requests[team] += 1
        if cost is not None:
            self.spent[team] += cost.amount

    @zml.hookimpl
    def zml_attempt_failed(self, attempt: zml.Attempt) -> None:
        self.failed_attempts[attempt.node_id] += 1

    def report(self) -> list[str]:
        """One line per team, most expensive first."""
        return [
            f"{team}: {self.requests[team]} request(s), {self.spent[team]:.6f} USD"
            for team in sorted(self.requests, key=lambda t: -self.spent[t])
        ]
