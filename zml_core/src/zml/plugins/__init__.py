"""zml's plugin system, on pluggy: hook specifications, the plugin manager, built-in plugins.

Write a plugin with :data:`zml.hookimpl` and the hooks of :mod:`zml.plugins.hookspecs`
(guide: ``docs/plugins.md``). Install it as an entry point of group ``zml``, or register it in
code, for one client (``client.plugins.register(obj)``) or for every client built afterwards
(``zml.plugins.register(obj)``).

Only the hook markers are imported with ``zml``; the manager, the built-in plugins and the
installed plugins are loaded when the first client is built.
"""

from __future__ import annotations

from typing import Any

from .hookspecs import FleetSource, PolicySource, VersionedPolicySource, hookimpl, hookspec

__all__ = [
    "FleetSource",
    "PolicySource",
    "VersionedPolicySource",
    "hookimpl",
    "hookspec",
    "register",
    "unregister",
]


def register(plugin: Any, name: str | None = None) -> str | None:
    """Register ``plugin`` for every client built from now on (process-wide); return its name.

    Loads the installed plugins first, if that was not done yet. Raises
    ``pluggy.PluginValidationError`` for an unknown (misspelled) hook implementation.
    """
    from .manager import process_manager

    return process_manager().register(plugin, name)


def unregister(plugin: Any | None = None, name: str | None = None) -> Any | None:
    """Unregister a process-wide plugin (by object or name) for clients built from now on."""
    from .manager import process_manager

    return process_manager().unregister(plugin, name)
