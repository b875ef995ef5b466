"""zml-redis: shared fleet state and a live policy store for zml replicas, in Redis.

Set ``ZML_REDIS_URL`` (e.g. ``redis://127.0.0.1:6379/0``) in every replica's environment and
each zml client built there:

* takes a lease in Redis for every slot it reserves on a node (one atomic script per request,
  leases renewed in the background and expiring 10 s after their holder dies), so replicas
  together never exceed a node's ``max_concurrency + max_queue``; and routes on the global
  load of every node;
* shares health scores and circuit breakers with the other replicas (pub/sub);
* looks named policies up in the Redis policy store (``zml policies push/list/show/rm``),
  switching to a pushed policy within a second;
* keeps serving on its own state, with one warning, while Redis is unreachable, and resumes
  when it is back.

See the README for keys, settings and tests.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .hub import Hub
    from .hubs import hub_for
    from .ledger import RedisLedger
    from .policies import CorruptStoreError, PolicyStore, RedisPolicySource, Snapshot, StoreError
    from .settings import Settings, SettingsError

ENV_URL = "ZML_REDIS_URL"
"""The variable that turns the plugin on (the rest of the settings: :mod:`zml_redis.settings`)."""

# The names are loaded on first use: zml loads this package's ``plugin`` module in every client
# process, and importing ``redis`` (with its OpenTelemetry bits) costs about half a second that
# a process without ``ZML_REDIS_URL`` never needs.
_EXPORTS = {
    "Hub": "hub",
    "hub_for": "hubs",
    "RedisLedger": "ledger",
    "PolicyStore": "policies",
    "RedisPolicySource": "policies",
    "Snapshot": "policies",
    "StoreError": "policies",
    "CorruptStoreError": "policies",
    "Settings": "settings",
    "SettingsError": "settings",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "ENV_URL",
    "CorruptStoreError",
    "Hub",
    "PolicyStore",
    "RedisLedger",
    "RedisPolicySource",
    "Settings",
    "SettingsError",
    "Snapshot",
    "StoreError",
    "hub_for",
]
