"""zml-policy-sqlite: zml routing policies kept in a SQLite database.

Edit policies with the ``zml-policy-sqlite`` command (``add``, ``update``, ``list``, ``show``,
``rm``); every change is validated against the fleet registry before it is written. Running
zml clients whose environment has ``ZML_POLICY_SQLITE_DB=/path/to/policies.db`` look policies up
in that database by name (``infer(policy="name")``) and see each change on their next request,
without a restart: the plugin checks SQLite's ``PRAGMA data_version`` per lookup and re-reads
only after another connection committed.
"""

from __future__ import annotations

from .source import SQLitePolicySource
from .store import ENV_DB, PolicyStore

__all__ = ["ENV_DB", "PolicyStore", "SQLitePolicySource"]
