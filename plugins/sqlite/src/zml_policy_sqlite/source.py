"""The read side: a zml policy source over the database, cheap to poll and never blocking.

A client asks ``version()`` on every named-policy lookup, synchronously and before the
request's deadline applies, so a lookup must not wait for the file. The source answers from
a snapshot of the whole table kept in memory, and reads the table again only when SQLite's
``PRAGMA data_version`` moved (it changes exactly when another connection committed to the
file): one query of microseconds per lookup while nothing changes. Each check also runs one
``stat`` of the path: when it names another file than the one open (``os.replace`` of a
regenerated file, a restore from backup), the connection is closed and the new file read.

When the file cannot be read (another connection holds a lock: a long write, ``BEGIN
EXCLUSIVE``; a disk error), the read connection gives up after ``busy_timeout_s`` (50 ms),
and a thread that finds another one reading does not wait for it. The source then keeps
answering from its last snapshot, logs one warning per outage on the ``zml.policy_sqlite``
logger, and tries the file again at most every ``retry_interval_s`` (1 s): the policies it
serves are stale by at most the outage plus that interval. A file deleted after it was read
is such an outage too (it is not created again, empty): the last snapshot is served until a
file is back at the path. Only a source that has never read the file fails, with
:class:`zml.PolicyConfigError`.

The source never creates the file (only ``zml-policy-sqlite add`` and ``init`` do): a mistyped
path must not become an empty database that answers every name with "unknown policy". A source
whose file does not exist yet is one that has never read it: ``version()`` is 0 and named
lookups fail with a :class:`zml.PolicyConfigError` naming the missing path and how to create
it. Each lookup then costs one ``stat`` (no back-off), so the lookup after the file appears
(created by ``add`` in another process) reads it.
"""

from __future__ import annotations

import logging
import math
import os
import sqlite3
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zml

from .store import TABLE, connect, create_hint, decode, repair_hint

__all__ = ["SQLitePolicySource"]

log = logging.getLogger("zml.policy_sqlite")

_FileId = tuple[int, int]
"""``(st_dev, st_ino)``: which file a path names (another one after ``os.replace``)."""


class _FileGone(OSError):
    """The database file was deleted (or is being replaced) after it was read."""


class _FileMissing(OSError):
    """The database file does not exist, and the source has never read it."""


def _file_id(path: str) -> _FileId | None:
    """Which file ``path`` names now, or None when there is none (one ``stat``: microseconds)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


@dataclass(frozen=True)
class _Snapshot:
    """The table as last read: ``serial`` changes exactly when ``rows`` did."""

    serial: int
    data_version: int
    rows: Mapping[str, str]
    """Name → the stored ``fields`` text (decoded on lookup: a bad row fails only its name)."""


def _seconds(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value < 0:
        raise zml.PolicyConfigError(
            f"SQLitePolicySource: {name} must be a finite number of seconds >= 0, "
            f"got {value!r}",
            field=name,
            value=value,
        )
    return float(value)


class SQLitePolicySource:
    """A :class:`zml.plugins.PolicySource` (with ``version()``) over one database file.

    The connection is opened on first use and shared by the threads that use the source; it is
    reopened when the path names another file. The file is never created: while it does not
    exist, a client can be built (``version()`` is 0) but its named lookups fail with
    :class:`zml.PolicyConfigError` naming the path, and the lookup after the file appears reads
    it. See the module docstring for what happens while the file is locked or deleted.

    Args:
        path: the database file.
        poll_interval_s: ask ``PRAGMA data_version`` at most this often (0: on every lookup).
        busy_timeout_s: how long one read waits for another connection's lock.
        retry_interval_s: after a failed read, how long lookups use the last snapshot before
            the file is tried again.
        origin: what named ``path``, for the error about a missing file (the plugin passes
            ``"ZML_POLICY_SQLITE_DB"``: "ZML_POLICY_SQLITE_DB names /abs/path, which does not
            exist: ..., or fix the variable").
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        poll_interval_s: float = 0.0,
        *,
        busy_timeout_s: float = 0.05,
        retry_interval_s: float = 1.0,
        origin: str | None = None,
    ) -> None:
        if not isinstance(path, str | os.PathLike):
            raise zml.PolicyConfigError(
                f"SQLitePolicySource: path must be a file path, got {type(path).__name__}",
                field="path",
            )
        self.path = os.fspath(path)
        self.name = f"sqlite:{self.path}"
        self.poll_interval_s = _seconds("poll_interval_s", poll_interval_s)
        self.busy_timeout_s = _seconds("busy_timeout_s", busy_timeout_s)
        self.retry_interval_s = _seconds("retry_interval_s", retry_interval_s)
        if origin is not None and not isinstance(origin, str):
            raise zml.PolicyConfigError(
                f"SQLitePolicySource: origin must be a str (what named the path, such as an "
                f"environment variable) or None, got {type(origin).__name__}",
                field="origin",
            )
        self.origin = origin
        self._lock = threading.Lock()
        self._conn: sqlite3.Connection | None = None
        self._file: _FileId | None = None  # the file the connection has open
        self._snapshot: _Snapshot | None = None
        self._error: str | None = None  # the current outage's cause (None: the last read worked)
        self._missing = False  # the file did not exist at the last try (and was never read)
        self._next_poll = 0.0
        self._next_retry = 0.0

    def __repr__(self) -> str:
        return f"SQLitePolicySource({self.path!r})"

    # --- reading ---------------------------------------------------------------------------

    def _refresh(self) -> _Snapshot | None:
        """The snapshot, read again first if due; None while the file was never read."""
        snapshot = self._snapshot
        if time.monotonic() < self._next_poll:
            return snapshot
        # With a snapshot, never queue behind a reading thread: what it reads is what this
        # lookup would have read. Without one, wait for that read (bounded: a few busy timeouts).
        if snapshot is not None:
            if not self._lock.acquire(blocking=False):
                return snapshot
        elif not self._lock.acquire(timeout=4 * self.busy_timeout_s + 0.5):
            return self._snapshot
        try:
            now = time.monotonic()
            if self._error is not None and now < self._next_retry:
                return self._snapshot
            self._next_poll = now + self.poll_interval_s
            try:
                self._snapshot = self._read()
            except (sqlite3.Error, OSError) as exc:
                self._failed(exc, now)
            else:
                if self._missing:
                    log.info("policy source %r: the database file exists now", self.name)
                elif self._error is not None:
                    log.info("policy source %r: the database is readable again", self.name)
                self._error = None
                self._missing = False
            return self._snapshot
        finally:
            self._lock.release()

    def _read(self) -> _Snapshot:
        """Read ``data_version``, and the table if it moved (call with the lock held)."""
        old = self._snapshot
        conn, reopened = self._open()
        data_version = int(conn.execute("PRAGMA data_version").fetchone()[0])
        # data_version counts per connection: after reopening, only the rows can tell.
        if old is not None and not reopened and old.data_version == data_version:
            return old
        rows = {name: text for name, text in conn.execute(f"SELECT name, fields FROM {TABLE}")
                if isinstance(name, str)}
        if old is not None and old.rows == rows:
            return _Snapshot(old.serial, data_version, old.rows)
        return _Snapshot(1 if old is None else old.serial + 1, data_version, rows)

    def _open(self) -> tuple[sqlite3.Connection, bool]:
        """A connection to the file ``path`` names now, and whether it was (re)opened.

        A connection keeps reading the file it opened, so after ``os.replace`` (a restore, a
        regenerated file) it is closed and the new file opened. A missing file is never
        created: once the table was read it is an outage (``_FileGone``), before that a file
        that does not exist yet (``_FileMissing``).
        """
        found = _file_id(self.path)
        if found is None:
            if self._snapshot is not None:
                raise _FileGone(f"the file {self.path} no longer exists (deleted, or being "
                                "replaced)")
            raise _FileMissing(f"the file {self.path} does not exist")
        if self._conn is not None and found == self._file:
            return self._conn, False
        self._close()
        # stat before connect: a file swapped in between is seen, and reopened, next time;
        # one deleted in between fails to open ("unable to open database file"), not created
        self._conn = connect(self.path, timeout=self.busy_timeout_s, create=False)
        self._file = found
        return self._conn, True

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def _failed(self, exc: sqlite3.Error | OSError, now: float) -> None:
        """Record a failed read (lock held): back off, warn once per outage, reconnect later."""
        self._close()  # a fresh connection on retry, whatever went wrong
        # A file that does not exist yet is looked for again by the next lookup (one stat):
        # there is no lock to wait for, and the lookup after `add` created it must read it.
        self._missing = isinstance(exc, _FileMissing)
        self._next_retry = now if self._missing else now + self.retry_interval_s
        first = self._error is None
        self._error = (str(exc) if isinstance(exc, _FileGone | _FileMissing)
                       else f"{type(exc).__name__}: {exc}")
        if first and self._snapshot is not None:
            log.warning(
                "policy source %r cannot read the database (%s); serving the %d policies "
                "it read last until it can (trying again every %gs)",
                self.name, self._error, len(self._snapshot.rows), self.retry_interval_s,
            )

    def _current(self, what: str) -> _Snapshot:
        snapshot = self._refresh()
        if snapshot is None and self._missing:
            raise self._missing_error(what)
        if snapshot is None:
            raise zml.PolicyConfigError(
                f"policy source {self.name!r} cannot {what}: it has not been able to read "
                f"the database yet ({self._error or 'another thread is still reading it'}); "
                "check that the file is a readable SQLite database that no connection keeps "
                "locked (a long write, BEGIN EXCLUSIVE), then retry",
                field="policy",
                source=self.name,
            )
        return snapshot

    def _missing_error(self, what: str) -> zml.PolicyConfigError:
        where = os.path.abspath(self.path)
        if self.origin:
            named, fix = f"{self.origin} names {where}, which does not exist", "fix the variable"
        else:
            named, fix = f"the database file {where} does not exist", "fix the path"
        return zml.PolicyConfigError(
            f"policy source {self.name!r} cannot {what}: {named}: {create_hint(where)}, or "
            f"{fix} (the client reads the file once it exists, without a restart; it never "
            "creates it)",
            field="policy",
            value=where,
            source=self.name,
        )

    # --- PolicySource ----------------------------------------------------------------------

    def version(self) -> int:
        """A token that changes when the stored policies did (0 until the first read).

        Asked on every lookup by default (one ``PRAGMA data_version``, a few microseconds), so
        an edit is seen by the next request; with ``poll_interval_s`` > 0, at most that often.
        Never raises for the database: while it cannot be read, the last token stays.
        """
        snapshot = self._refresh()
        return 0 if snapshot is None else snapshot.serial

    def get(self, name: str) -> dict[str, Any] | None:
        """The stored fields of policy ``name`` (``name`` included), or None.

        Raises:
            zml.PolicyConfigError: the database was never readable, or the row is not a JSON
                object (edited by hand).
        """
        text = self._current(f"look up policy {name!r}").rows.get(name)
        if text is None:
            return None
        try:
            fields = decode(name, text)
        except ValueError as exc:
            raise zml.PolicyConfigError(
                f"policy source {self.name!r}: policy {name!r} is not stored as a JSON object "
                f"({exc}); {repair_hint(name, self.path)}",
                field="policy",
                value=name,
                source=self.name,
            ) from None
        fields["name"] = name
        return fields

    def list(self) -> list[str]:
        """The stored policy names, sorted (``zml.PolicyConfigError`` if never readable)."""
        return sorted(self._current("list policies").rows)

    def close(self) -> None:
        """Close the connection (it is opened again, and the table read, if the source is used)."""
        with self._lock:
            self._close()

    def __del__(self) -> None:
        # The last client using the source is gone: close the connection (unreachable, so no
        # thread is reading) rather than leave it to sqlite3, which warns on 3.13.
        conn = getattr(self, "_conn", None)
        if conn is not None:
            conn.close()
