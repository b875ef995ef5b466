"""zml-policy-sqlite: zml routing policies kept in a SQLite database.

Edit policies with the ``zml-policy-sqlite`` command (``add``, ``update``, ``list``, ``show``,
``rm``, and ``init`` for an empty database); every change is validated against the fleet
registry before it is written. Only ``add`` and ``init`` create the file: neither the other
commands nor the clients create a database where none exists.

Running zml clients whose environment has ``ZML_POLICY_SQLITE_DB=/path/to/policies.db`` look
policies up in that database by name (``infer(policy="name")``) and see each change on their
next request, without a restart: the plugin checks SQLite's ``PRAGMA data_version`` per lookup
and re-reads only after another connection committed (or opens the new file when the path
names another one: a restore, a regenerated file). A locked or deleted database does not hold
requests up: lookups use the last policies read. A database file that does not exist yet fails
named lookups, naming the path, until it is created (see :mod:`zml_policy_sqlite.source`).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .source import SQLitePolicySource
    from .store import PolicyStore

__all__ = ["ENV_DB", "PolicyStore", "SQLitePolicySource"]

ENV_DB = "ZML_POLICY_SQLITE_DB"
"""The database the plugin reads (and the command line's default ``--db``)."""

# The classes are loaded on first use: zml loads this package's ``plugin`` module in every
# client process, and one without ``ZML_POLICY_SQLITE_DB`` never needs sqlite3.
_EXPORTS = {"PolicyStore": "store", "SQLitePolicySource": "source"}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
