"""The database: one table of policies, each a JSON object of ``zml.Policy`` fields.

Schema (created on first use)::

    CREATE TABLE zml_policies (
        name       TEXT PRIMARY KEY,   -- the policy's name
        fields     TEXT NOT NULL,      -- JSON object of zml.Policy fields, without name
        updated_at TEXT NOT NULL       -- ISO 8601, UTC
    )

:class:`PolicyStore` writes without validating: validation needs a fleet registry, which is the
command line's business (see :mod:`.cli`). It only refuses what JSON cannot hold (NaN,
infinity), so anything may read the table as strict JSON; zml clients read it through
:class:`~zml_policy_sqlite.source.SQLitePolicySource`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any

from . import ENV_DB

__all__ = ["ENV_DB", "SCHEMA", "PolicyStore", "StoreError"]

TABLE = "zml_policies"
SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} ("
    "name TEXT PRIMARY KEY, fields TEXT NOT NULL, updated_at TEXT NOT NULL)"
)


class StoreError(Exception):
    """A store operation that cannot be done (the name exists already, or does not exist, or
    a field is a number JSON cannot hold)."""


def connect(path: str | os.PathLike[str], timeout: float = 5.0) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit), with the table created.

    ``timeout`` is how long a statement waits for another connection's lock before it fails
    with ``sqlite3.OperationalError`` ("database is locked").
    """
    conn = sqlite3.connect(
        os.fspath(path), timeout=timeout, isolation_level=None, check_same_thread=False
    )
    try:
        conn.execute(SCHEMA)
    except BaseException:
        conn.close()
        raise
    return conn


def decode(name: str, text: str) -> dict[str, Any]:
    """A row's ``fields`` as a dict (raises ValueError when it is not a JSON object)."""
    fields = json.loads(text)
    if not isinstance(fields, dict):
        raise ValueError(f"policy {name!r}: stored fields are not a JSON object")
    return fields


class PolicyStore:
    """Policies in one SQLite file: read and write (the command line's side).

    Args:
        path: the database file (created, with its table, if missing).
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._conn = connect(self.path)

    def close(self) -> None:
        """Close the connection."""
        self._conn.close()

    def __enter__(self) -> PolicyStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, name: str) -> dict[str, Any] | None:
        """The fields of policy ``name`` (without ``name``), or None."""
        row = self._conn.execute(f"SELECT fields FROM {TABLE} WHERE name = ?", (name,)).fetchone()
        return None if row is None else decode(name, row[0])

    def items(self) -> list[tuple[str, dict[str, Any]]]:
        """Every (name, fields), by name."""
        rows = self._conn.execute(f"SELECT name, fields FROM {TABLE} ORDER BY name").fetchall()
        return [(name, decode(name, text)) for name, text in rows]

    def add(self, name: str, fields: dict[str, Any]) -> None:
        """Insert a new policy (StoreError if ``name`` exists)."""
        try:
            with self._transaction():
                self._conn.execute(
                    f"INSERT INTO {TABLE} (name, fields, updated_at) VALUES (?, ?, ?)",
                    (name, _encode(fields), _now()),
                )
        except sqlite3.IntegrityError:
            raise StoreError(
                f"policy {name!r} already exists in {self.path}; use 'update' to change it"
            ) from None

    def put(self, name: str, fields: dict[str, Any]) -> None:
        """Replace the fields of an existing policy (StoreError if there is none)."""
        with self._transaction():
            cursor = self._conn.execute(
                f"UPDATE {TABLE} SET fields = ?, updated_at = ? WHERE name = ?",
                (_encode(fields), _now(), name),
            )
            if cursor.rowcount == 0:
                raise StoreError(f"no policy {name!r} in {self.path}; use 'add' to create it")

    def remove(self, name: str) -> None:
        """Delete a policy (StoreError if there is none)."""
        with self._transaction():
            cursor = self._conn.execute(f"DELETE FROM {TABLE} WHERE name = ?", (name,))
            if cursor.rowcount == 0:
                raise StoreError(f"no policy {name!r} in {self.path}")

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield
        except BaseException:
            self._conn.execute("ROLLBACK")
            raise
        self._conn.execute("COMMIT")


def _encode(fields: dict[str, Any]) -> str:
    try:  # strict JSON: other readers of the table may not accept NaN or Infinity
        return json.dumps(fields, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except ValueError:
        raise StoreError(
            "a policy field is not a finite number (NaN or infinity); JSON cannot store it"
        ) from None


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")
