"""The zml plugin (entry point ``redis`` of group ``zml``).

With ``ZML_REDIS_URL`` set when a client is built, the client gets:

* a slot ledger (``zml_slot_ledger``): leases in Redis, so replicas never oversubscribe a node
  together, with the global load of every node fed into its routing;
* shared health: its failures (and the recovery that follows) are published, and the other
  replicas' are applied to its fleet, so health scores and circuit breakers agree;
* the Redis policy store as a policy source, ahead of ``zml.toml``'s tables, reloaded live.

Without the variable the plugin does nothing (no import of ``redis``, no connection), and its
telemetry hooks return at once. The ``zml policies`` command is always added.
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import zml
from zml.plugins import PolicySource

from . import ENV_URL

if TYPE_CHECKING:
    import argparse

    from zml.config import Registry
    from zml.dispatch import CallView as Call
    from zml.errors import NodeError, ZMLError
    from zml.fleet import Fleet
    from zml.ledger import SlotLedger
    from zml.types import Attempt, RoutingInfo

    from .hub import Hub
    from .policies import RedisPolicySource

__all__ = [
    "reset",
    "zml_attempt_failed",
    "zml_idle",
    "zml_register_commands",
    "zml_register_policy_sources",
    "zml_request_completed",
    "zml_request_failed",
    "zml_slot_ledger",
]

_sources: dict[int, RedisPolicySource] = {}
_lock = threading.Lock()


def _hub() -> Hub | None:
    if not os.environ.get(ENV_URL, "").strip():
        return None  # the settings module is not even imported (the first request's cost)
    from .settings import Settings, SettingsError

    try:
        settings = Settings.from_env()
    except SettingsError as exc:
        raise SettingsError(f"zml-redis: {exc}", field=exc.field, value=exc.value) from None
    if settings is None:
        return None
    from .hubs import hub_for

    return hub_for(settings)


def _source(hub: Hub) -> RedisPolicySource:
    from .policies import RedisPolicySource

    with _lock:
        source = _sources.get(id(hub))
        if source is None or source.hub is not hub:
            source = _sources[id(hub)] = RedisPolicySource(hub)
        return source


def reset() -> None:
    """Forget this process's hubs and sources (closing them): for tests."""
    with _lock:
        _sources.clear()
    from .hubs import close_all

    close_all()


@zml.hookimpl
def zml_slot_ledger(fleet: Fleet, registry: Registry) -> SlotLedger | None:
    """A Redis slot ledger for the client's fleet when ``ZML_REDIS_URL`` is set."""
    hub = _hub()
    if hub is None or not hub.settings.ledger:
        return None
    from .ledger import RedisLedger

    return RedisLedger(hub, fleet)


@zml.hookimpl
def zml_register_policy_sources(register: Callable[[PolicySource], None]) -> None:
    """Register the Redis policy store when ``ZML_REDIS_URL`` is set."""
    hub = _hub()
    if hub is not None:
        register(_source(hub))


def zml_idle() -> bool:
    """Idle while no client of this process has a Redis ledger (none was built: the ledger
    module is not even imported): then every notification hook here has nothing to do, and
    zml skips the hooks only idle plugins implement (see ``zml.plugins.manager.IDLE_METHOD``)."""
    return "zml_redis.ledger" not in sys.modules


def _hub_of(call: Call) -> Hub | None:
    """The hub of the call's client, if its ledger is ours (cheap: no import of redis)."""
    ledger = call.ledger
    if ledger is None:
        return None
    module = sys.modules.get("zml_redis.ledger")
    if module is None or not isinstance(ledger, module.RedisLedger):
        return None
    hub: Hub = ledger.hub
    return hub


@zml.hookimpl
def zml_attempt_failed(call: Call, attempt: Attempt, error: NodeError) -> None:
    """Publish a node-side failure (not a 429: rate limiting is load, not ill health)."""
    hub = _hub_of(call)
    if hub is not None and not isinstance(error, zml.RateLimitError):
        hub.publish_health(attempt.node_id, ok=False)


@zml.hookimpl
def zml_request_failed(call: Call, error: ZMLError) -> None:
    """Publish a stream that broke after its first token (dispatch marks the node for it)."""
    if isinstance(error, zml.IncompleteStreamError) and error.node_id:
        hub = _hub_of(call)
        if hub is not None:
            hub.publish_health(error.node_id, ok=False)


@zml.hookimpl
def zml_request_completed(call: Call, routing: RoutingInfo) -> None:
    """Publish a success on a node that had failed (successes of healthy nodes are not sent)."""
    hub = _hub_of(call)
    if hub is not None:
        hub.publish_health(routing.node_id, ok=True)


@zml.hookimpl
def zml_register_commands(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """Add ``zml policies push|list|show|rm``."""
    from .cli import add_commands

    add_commands(subparsers)

