"""The zml plugin (entry point ``policy_sqlite`` of group ``zml``).

When ``ZML_POLICY_SQLITE_DB`` names a database file, every zml client registers it as a
policy source (before the ``zml.toml`` tables, which the built-in source holds); without the
variable, the plugin registers nothing. The variable is read when a client is built. The file
is not created: while it does not exist, the client's named lookups fail with
``zml.PolicyConfigError`` naming the variable and the path (a mistyped path is reported, not
turned into an empty database), and the lookup after it is created reads it.

Clients that use the same file share one source (one connection and one snapshot per file):
it only reads, so what one client sees never depends on another, and a client built while
the file is locked can answer from the snapshot the others read. The source lives as long as
a client uses it (the map of sources holds it weakly).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import zml
from zml.plugins import PolicySource

from . import ENV_DB

if TYPE_CHECKING:
    from .source import SQLitePolicySource

__all__ = ["source_for", "zml_register_policy_sources"]

_sources: weakref.WeakValueDictionary[str, SQLitePolicySource] = weakref.WeakValueDictionary()
"""Absolute path → the source the live clients share for it."""
_lock = threading.Lock()


def source_for(path: str) -> SQLitePolicySource:
    """The source for the database at ``path`` that the process's clients share (one
    connection per file), made if no live client uses one."""
    key = os.path.abspath(path)
    with _lock:
        source = _sources.get(key)
        if source is None:
            from .source import SQLitePolicySource  # sqlite3 only once a database is named

            source = _sources[key] = SQLitePolicySource(key, origin=ENV_DB)
        return source


@zml.hookimpl
def zml_register_policy_sources(register: Callable[[PolicySource], None]) -> None:
    """Register the database named by ``ZML_POLICY_SQLITE_DB``, if set (zml calls this once per
    client, when it is built: the client keeps that database)."""
    path = os.environ.get(ENV_DB, "").strip()
    if path:
        register(source_for(path))
