"""The read side: a zml policy source over the database, cheap to poll for changes.

A client asks ``version()`` on every named-policy lookup; it is SQLite's ``PRAGMA
data_version``, which changes exactly when another connection (the command line, another
tool) committed to the file. The query costs microseconds and is made at most once a
millisecond; only when the version moved does the client drop its cached policies and read
the names it is asked for again.
"""

from __future__ import annotations

import os
import sqlite3
import threading
import time
from typing import Any

from .store import TABLE, connect, decode

__all__ = ["SQLitePolicySource"]


class SQLitePolicySource:
    """A :class:`zml.plugins.PolicySource` (with ``version()``) over one database file.

    The connection is opened on first use (creating the file and its table if missing, so a
    client may start before the first policy is added) and shared by the threads of the
    process under a lock.
    """

    def __init__(self, path: str | os.PathLike[str], poll_interval_s: float = 0.0) -> None:
        self.path = os.fspath(path)
        self.name = f"sqlite:{self.path}"
        self.poll_interval_s = poll_interval_s
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._version = 0
        self._next_poll = 0.0

    def __repr__(self) -> str:
        return f"SQLitePolicySource({self.path!r})"

    def _query(self, sql: str, params: tuple[Any, ...] = ()) -> list[Any]:
        with self._lock:
            if self._conn is None:
                self._conn = connect(self.path)
            return self._conn.execute(sql, params).fetchall()

    def version(self) -> int:
        """``PRAGMA data_version``: changes when another connection commits.

        Asked on every lookup by default (a few microseconds), so an edit is seen by the next
        request; with ``poll_interval_s`` > 0, at most that often (lookups in between reuse
        the last answer, and a change is seen within that interval).
        """
        now = time.monotonic()
        if now >= self._next_poll:
            self._version = int(self._query("PRAGMA data_version")[0][0])
            self._next_poll = now + self.poll_interval_s
        return self._version

    def get(self, name: str) -> dict[str, Any] | None:
        """The stored fields of policy ``name`` (``name`` included), or None."""
        rows = self._query(f"SELECT fields FROM {TABLE} WHERE name = ?", (name,))
        if not rows:
            return None
        fields = decode(name, rows[0][0])
        fields["name"] = name
        return fields

    def list(self) -> list[str]:
        """The stored policy names, sorted."""
        return [row[0] for row in self._query(f"SELECT name FROM {TABLE} ORDER BY name")]

    def close(self) -> None:
        """Close the connection (it is opened again if the source is used)."""
        with self._lock:
            if self._conn is not None:
                self._conn.close()
                self._conn = None
