"""The zml plugin (entry point ``policy_sqlite`` of group ``zml``).

When ``ZML_POLICY_SQLITE_DB`` names a database file, every zml client registers it as a
policy source (before the ``zml.toml`` tables, which the built-in source holds); without the
variable, the plugin registers nothing. The variable is read when a client is built.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

import zml
from zml.plugins import PolicySource

from . import ENV_DB

if TYPE_CHECKING:
    from .source import SQLitePolicySource

__all__ = ["source_for", "zml_register_policy_sources"]

_sources: dict[str, SQLitePolicySource] = {}
_lock = threading.Lock()


def source_for(path: str) -> SQLitePolicySource:
    """The process's one source for the database at ``path`` (one connection per file)."""
    key = os.path.abspath(path)
    with _lock:
        source = _sources.get(key)
        if source is None:
            from .source import SQLitePolicySource  # sqlite3 only once a database is named

            source = _sources[key] = SQLitePolicySource(key)
        return source


@zml.hookimpl
def zml_register_policy_sources(register: Callable[[PolicySource], None]) -> None:
    """Register the database named by ``ZML_POLICY_SQLITE_DB``, if set."""
    path = os.environ.get(ENV_DB, "").strip()
    if path:
        register(source_for(path))
