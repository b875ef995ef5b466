"""SQLitePolicySource: answers from its last snapshot while the file is locked, never waits long."""

from __future__ import annotations

import logging
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

import zml
from zml_policy_sqlite import PolicyStore, SQLitePolicySource

from .conftest import locked

A = {"accelerator_chain": ["H100"]}
B = {"accelerator_chain": ["MI300X"]}


@pytest.fixture
def path(tmp_path: Path) -> Path:
    path = tmp_path / "p.db"
    with PolicyStore(path) as store:
        store.add("a", A)
        store.add("b", B)
    return path


def warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records
            if r.name == "zml.policy_sqlite" and r.levelno == logging.WARNING]


def test_a_locked_database_is_answered_from_the_last_snapshot_with_one_warning(
    path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="zml.policy_sqlite")
    source = SQLitePolicySource(path, retry_interval_s=0)  # every lookup tries the file again
    try:
        token = source.version()
        with locked(path):
            for _ in range(3):
                assert source.version() == token
                assert source.get("b") == {"name": "b", **B}
                assert source.list() == ["a", "b"]
            assert source.get("c") is None
        assert len(warnings(caplog)) == 1
        assert "database is locked" in warnings(caplog)[0].getMessage()
        # readable again: the next lookup reads the file, and sees what was committed since
        with PolicyStore(path) as store:
            store.put("b", A)
        assert source.version() != token
        assert source.get("b") == {"name": "b", **A}
        with locked(path):  # a new outage is reported again, once
            assert source.get("b") == {"name": "b", **A}
            assert source.get("a") == {"name": "a", **A}
        assert len(warnings(caplog)) == 2
    finally:
        source.close()


def test_threads_looking_up_during_a_lock_all_get_the_snapshot(path: Path) -> None:
    source = SQLitePolicySource(path)
    try:
        token = source.version()

        def lookup(name: str) -> tuple[int, dict[str, Any] | None]:
            return source.version(), source.get(name)

        with locked(path), ThreadPoolExecutor(max_workers=4) as pool:
            futures = [pool.submit(lookup, "ab"[i % 2]) for i in range(8)]
            results = [f.result(timeout=60) for f in futures]
        assert results == [(token, {"name": "ab"[i % 2], **(A, B)[i % 2]}) for i in range(8)]
    finally:
        source.close()


def test_a_source_that_never_read_the_database_fails_with_a_typed_error(path: Path) -> None:
    source = SQLitePolicySource(path, retry_interval_s=0)
    try:
        with locked(path):
            assert source.version() == 0  # a client can still be built
            with pytest.raises(zml.PolicyConfigError, match="database is locked") as info:
                source.get("a")
            assert info.value.source == f"sqlite:{path}" and "BEGIN EXCLUSIVE" in str(info.value)
            with pytest.raises(zml.PolicyConfigError, match="cannot list policies"):
                source.list()
        assert source.get("a") == {"name": "a", **A}
        assert source.version() != 0
    finally:
        source.close()


def test_an_unreadable_file_fails_with_a_typed_error(tmp_path: Path) -> None:
    path = tmp_path / "not.db"
    path.write_bytes(b"this is not a SQLite database, but long enough to have a header" * 64)
    source = SQLitePolicySource(path)
    try:
        assert source.version() == 0
        with pytest.raises(zml.PolicyConfigError, match="not a database"):
            source.get("a")
    finally:
        source.close()


def test_a_commit_made_while_closed_is_seen_after_reopening(path: Path) -> None:
    source = SQLitePolicySource(path)
    try:
        token = source.version()
        source.close()
        with PolicyStore(path) as store:
            store.put("a", B)
        assert source.version() != token
        assert source.get("a") == {"name": "a", **B}
    finally:
        source.close()


def test_a_row_that_is_not_a_json_object_fails_only_its_own_lookup(path: Path) -> None:
    with sqlite3.connect(path) as conn:
        conn.execute("UPDATE zml_policies SET fields = '[1]' WHERE name = 'a'")
    conn.close()
    source = SQLitePolicySource(path)
    try:
        with pytest.raises(zml.PolicyConfigError, match="'a' is not stored as a JSON object"):
            source.get("a")
        assert source.get("b") == {"name": "b", **B}
    finally:
        source.close()


@pytest.mark.parametrize("kwargs", [
    {"poll_interval_s": float("nan")},
    {"busy_timeout_s": -1},
    {"retry_interval_s": float("inf")},
    {"retry_interval_s": "1"},
])
def test_bad_settings_are_refused(tmp_path: Path, kwargs: dict[str, Any]) -> None:
    (name,) = kwargs
    with pytest.raises(zml.PolicyConfigError, match=f"{name} must be a finite number"):
        SQLitePolicySource(tmp_path / "x.db", **kwargs)


def test_a_path_that_is_not_a_path_is_refused() -> None:
    with pytest.raises(zml.PolicyConfigError, match="path must be a file path, got int"):
        SQLitePolicySource(3)  # type: ignore[arg-type]
