"""The pluggy-backed :class:`zml.dispatch.Observer`: dispatch's hook points, fanned out to plugins.

Dispatch calls its observer at fixed points of every request and requires that it never
raises. So each implementation is called on its own, and an exception in one is logged (once
per plugin and hook, at WARNING with its traceback on logger ``zml.plugins``; later ones at
DEBUG) and skipped: the request goes on, and the other plugins still see the event.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

from ..dispatch import Observer
from ..types import Cost

if TYPE_CHECKING:
    import pluggy

    from ..config import AcceleratorConfig, NodeConfig, Registry
    from ..dispatch import Call
    from ..errors import NodeError, ZMLError
    from ..fleet import Fleet
    from ..ledger import SlotLedger
    from ..types import Attempt, RoutingInfo
    from .manager import PluginManager

__all__ = ["PluginObserver"]

logger = logging.getLogger("zml.plugins")

_reported: set[tuple[str, str]] = set()
_reported_lock = threading.Lock()


def _report(impl: pluggy.HookImpl, hook: str, exc: BaseException) -> None:
    key = (impl.plugin_name, hook)
    with _reported_lock:
        first = key not in _reported
        _reported.add(key)
    if first:
        logger.warning(
            "zml plugin %r raised in %s (the request goes on; further errors of this plugin "
            "in this hook are logged at DEBUG)",
            impl.plugin_name,
            hook,
            exc_info=exc,
        )
    else:
        logger.debug("zml plugin %r raised in %s", impl.plugin_name, hook, exc_info=exc)


class PluginObserver(Observer):
    """Turns dispatch's observer calls into calls of the telemetry and cost hooks."""

    def __init__(self, pm: PluginManager) -> None:
        self.pm = pm

    def _notify(self, hook: str, kwargs: dict[str, Any]) -> None:
        for impl in self.pm.impls(hook):
            try:
                impl.function(*[kwargs[a] for a in impl.argnames])
            except Exception as exc:
                _report(impl, hook, exc)

    def started(self, call: Call) -> None:
        """Fan out to ``zml_request_started``."""
        if self.pm.impls("zml_request_started"):
            self._notify("zml_request_started", {"call": call, "metadata": call.metadata})

    def routed(self, call: Call, routing: RoutingInfo) -> None:
        """Fan out to ``zml_request_routed``."""
        if self.pm.impls("zml_request_routed"):
            self._notify(
                "zml_request_routed", {"call": call, "routing": routing, "metadata": call.metadata}
            )

    def attempt_failed(self, call: Call, attempt: Attempt, error: NodeError) -> None:
        """Fan out to ``zml_attempt_failed``."""
        self._notify(
            "zml_attempt_failed",
            {"call": call, "attempt": attempt, "error": error, "metadata": call.metadata},
        )

    def completed(
        self, call: Call, routing: RoutingInfo, usage: Mapping[str, Any] | None, held_s: float
    ) -> Cost | None:
        """Ask ``zml_attribute_cost`` (first non-None wins), then ``zml_request_completed``."""
        kwargs: dict[str, Any] = {
            "call": call,
            "routing": routing,
            "usage": usage,
            "held_s": held_s,
            "metadata": call.metadata,
        }
        cost: Cost | None = None
        impls = self.pm.impls("zml_attribute_cost")
        if impls:
            accelerator, node = _configs(call, routing)
            kwargs["accelerator"] = accelerator
            kwargs["node"] = node
            for impl in impls:
                try:
                    result = impl.function(*[kwargs[a] for a in impl.argnames])
                    if result is None:
                        continue
                    cost = result if isinstance(result, Cost) else Cost.model_validate(result)
                except Exception as exc:
                    _report(impl, "zml_attribute_cost", exc)
                    continue
                break
        kwargs["cost"] = cost
        self._notify("zml_request_completed", kwargs)
        return cost

    def errored(self, call: Call, error: ZMLError) -> None:
        """Fan out to ``zml_request_failed``."""
        self._notify("zml_request_failed", {"call": call, "error": error, "metadata": call.metadata})

    def cancelled(self, call: Call) -> None:
        """Fan out to ``zml_request_cancelled``."""
        self._notify("zml_request_cancelled", {"call": call, "metadata": call.metadata})


def _configs(call: Call, routing: RoutingInfo) -> tuple[AcceleratorConfig | None, NodeConfig | None]:
    d = call.d
    accelerator = d.registry.families.get(routing.accelerator)
    try:
        node: NodeConfig | None = d.fleet.node(routing.node_id).config
    except KeyError:
        node = None
    return accelerator, node


def slot_ledger(pm: PluginManager, fleet: Fleet, registry: Registry) -> SlotLedger | None:
    """Ask ``zml_slot_ledger`` for the client's ledger; a plugin that raises is skipped."""
    for impl in pm.impls("zml_slot_ledger"):
        kwargs: dict[str, Any] = {"fleet": fleet, "registry": registry}
        try:
            result = impl.function(*[kwargs[a] for a in impl.argnames])
        except Exception as exc:
            _report(impl, "zml_slot_ledger", exc)
            continue
        if result is not None:
            return cast("SlotLedger", result)
    return None
