"""The database: one table of policies, each a JSON object of ``zml.Policy`` fields.

Schema (created by every connection when missing; only ``add`` and ``init`` create the file)::

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
import shlex
import sqlite3
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import zml

from . import ENV_DB

__all__ = ["ENV_DB", "SCHEMA", "BadRowError", "PolicyStore", "StoreError"]

TABLE = "zml_policies"
SCHEMA = (
    f"CREATE TABLE IF NOT EXISTS {TABLE} ("
    "name TEXT PRIMARY KEY, fields TEXT NOT NULL, updated_at TEXT NOT NULL)"
)


class StoreError(zml.PolicyConfigError):
    """A store operation that cannot be done: the name exists already, or does not exist, a
    field is a number JSON cannot hold, or the file cannot be opened (``source`` is its path).
    """


class BadRowError(StoreError):
    """A stored row that is not a policy (edited by hand): its ``fields`` are not a JSON
    object. ``value`` is the policy's name, ``source`` the database's path."""


def connect(
    path: str | os.PathLike[str], timeout: float = 5.0, *, create: bool = True
) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit), with the table created.

    ``timeout`` is how long a statement waits for another connection's lock before it fails
    with ``sqlite3.OperationalError`` ("database is locked"). With ``create=False`` a missing
    file is not created (``sqlite3.OperationalError``, "unable to open database file"): a
    mistyped path must not leave an empty database behind.
    """
    target = os.fspath(path)
    if not create:
        target = Path(os.path.abspath(target)).as_uri() + "?mode=rw"
    conn = sqlite3.connect(
        target, timeout=timeout, isolation_level=None, check_same_thread=False, uri=not create
    )
    try:
        conn.execute(SCHEMA)
    except BaseException:
        conn.close()
        raise
    return conn


def create_hint(path: str) -> str:
    """How to create the database at ``path``: the commands that do (nothing else creates it)."""
    add = shlex.join(["zml-policy-sqlite", "add", "NAME", "--db", path])
    init = shlex.join(["zml-policy-sqlite", "init", "--db", path])
    return f"create it with '{add} ...' (or '{init}' for an empty one)"


def decode(name: str, text: object) -> dict[str, Any]:
    """A row's ``fields`` as a dict (raises ValueError, naming the policy, when they are not a
    JSON object: not JSON text, another JSON value, or a BLOB that is not JSON)."""
    if not isinstance(text, str | bytes | bytearray):
        raise ValueError(f"policy {name!r}: stored fields are {type(text).__name__}, "
                         "not JSON text")
    try:
        fields = json.loads(text)
    except ValueError as exc:  # JSONDecodeError, and UnicodeDecodeError for a BLOB
        raise ValueError(f"policy {name!r}: stored fields are not JSON ({exc})") from None
    if not isinstance(fields, dict):
        raise ValueError(f"policy {name!r}: stored fields are a JSON "
                         f"{type(fields).__name__}, not a JSON object")
    return fields


def repair_hint(name: str, path: str) -> str:
    """How to replace a row that is not a policy: remove it, then add it again."""
    rm = shlex.join(["zml-policy-sqlite", "rm", name, "--db", path])
    return f"remove it with '{rm}' and add it again with 'zml-policy-sqlite add'"


def open_error(path: str, exc: sqlite3.Error | None, *, create: bool = True) -> StoreError:
    """The StoreError for a database file that cannot be opened or read, with what to do.

    With ``create=False`` (a command that only reads or changes existing policies) a missing
    file is named as such, with the commands that create it; ``exc`` is None when the file was
    found missing before SQLite was asked.
    """
    where = Path(path)
    if where.is_dir():
        why = "it is a directory; pass the path of a database file"
    elif not where.parent.is_dir():
        why = f"the directory {str(where.parent)!r} does not exist; "
        why += ("create it first" if create else
                "nothing was created: fix --db (or $" + ENV_DB + "), or create the directory "
                f"and then the database ({create_hint(path)})")
    elif not create and not where.exists():
        return StoreError(
            f"the policy database {path!r} does not exist (nothing was created); "
            f"{create_hint(path)}, or fix --db (or ${ENV_DB})",
            field="db", value=path, source=path,
        )
    else:
        why = f"{exc}; check that it is a SQLite database this user may read and write"
    return StoreError(f"cannot open the policy database {path!r}: {why}",
                      field="db", value=path, source=path)


class PolicyStore:
    """Policies in one SQLite file: read and write (the command line's side).

    Args:
        path: the database file.
        create: create the file, with its table, if it is missing (the default). With
            ``create=False`` a missing file is a :class:`StoreError` naming it, and nothing is
            created: what the commands that only read or change existing policies use.

    ``created`` tells whether this store created the file.
    """

    def __init__(self, path: str | os.PathLike[str], *, create: bool = True) -> None:
        self.path = os.fspath(path)
        existed = os.path.exists(self.path)
        if not create and not existed:
            raise open_error(self.path, None, create=False)
        try:
            self._conn = connect(self.path, create=create)
        except sqlite3.Error as exc:
            raise open_error(self.path, exc, create=create) from None
        self.created = not existed

    def close(self) -> None:
        """Close the connection."""
        self._conn.close()

    def __enter__(self) -> PolicyStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def get(self, name: str) -> dict[str, Any] | None:
        """The fields of policy ``name`` (without ``name``), or None.

        Raises:
            BadRowError: the row is not a JSON object (edited by hand).
        """
        row = self._conn.execute(f"SELECT fields FROM {TABLE} WHERE name = ?", (name,)).fetchone()
        return None if row is None else self._decode(name, row[0])

    def items(self) -> list[tuple[str, dict[str, Any]]]:
        """Every (name, fields), by name (BadRowError for the first row that is not a policy)."""
        good, bad = self.scan()
        if bad:
            raise bad[0]
        return good

    def scan(self) -> tuple[list[tuple[str, dict[str, Any]]], list[BadRowError]]:
        """Every (name, fields) that is a policy, by name, and a BadRowError for each row that
        is not (so one row edited by hand does not hide the others)."""
        good: list[tuple[str, dict[str, Any]]] = []
        bad: list[BadRowError] = []
        rows = self._conn.execute(f"SELECT name, fields FROM {TABLE} ORDER BY name").fetchall()
        for name, text in rows:
            try:
                if not isinstance(name, str):
                    raise self._bad_name(name)
                good.append((name, self._decode(name, text)))
            except BadRowError as exc:
                bad.append(exc)
        return good, bad

    def _decode(self, name: str, text: object) -> dict[str, Any]:
        try:
            return decode(name, text)
        except ValueError as exc:
            raise BadRowError(f"{exc}, in {self.path}; {repair_hint(name, self.path)}",
                              field="fields", value=name, source=self.path) from None

    def _bad_name(self, name: object) -> BadRowError:
        return BadRowError(
            f"a row of {self.path} has a name that is not text ({name!r:.60}); delete it with "
            f"sqlite3: DELETE FROM {TABLE} WHERE typeof(name) != 'text'",
            field="name", value=name, source=self.path,
        )

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
