"""A database file replaced or deleted under running clients, and the database a client keeps.

Real SQLite files throughout; no timing: sources retry at once (``retry_interval_s=0``) where
an outage ends within a test (a file that does not exist yet is looked for on every lookup).
"""

from __future__ import annotations

import gc
import logging
import os
import subprocess
import sys
import weakref
from pathlib import Path

import httpx2
import pytest

import zml
from zml_policy_sqlite import PolicyStore, SQLitePolicySource
from zml_policy_sqlite.plugin import source_for

from .conftest import answer

A = {"accelerator_chain": ["H100"]}
B = {"accelerator_chain": ["MI300X"]}
MSGS = [{"role": "user", "content": "hi"}]


def write(path: Path, **policies: dict[str, list[str]]) -> Path:
    with PolicyStore(path) as store:
        for name, fields in policies.items():
            store.add(name, fields)
    return path


def replace(path: Path, **policies: dict[str, list[str]]) -> None:
    """Regenerate the database beside ``path`` and move it in (a restore, a rebuilt file)."""
    new = write(path.with_name(path.name + ".new"), **policies)
    os.replace(new, path)


def client(config: Path) -> zml.Client:
    return zml.Client(config=config,
                      http_client=httpx2.Client(transport=httpx2.MockTransport(answer)))


def family(c: zml.Client, policy: str) -> str:
    return c.infer("m", MSGS, policy=policy).routing.accelerator


def sqlite_sources(c: zml.Client) -> list[str]:
    return [s.name for s in c.policies.sources  # type: ignore[attr-defined]
            if isinstance(s, SQLitePolicySource)]


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.name == "zml.policy_sqlite" and r.levelno == logging.WARNING]


# --- the source: another file at the path ---------------------------------------------------


def test_a_file_moved_over_the_database_is_read_at_the_next_lookup(tmp_path: Path) -> None:
    path = write(tmp_path / "p.db", a=A)
    source = SQLitePolicySource(path)
    try:
        token = source.version()
        assert source.get("a") == {"name": "a", **A}
        replace(path, a=B, b=A)
        assert source.version() != token
        assert source.get("a") == {"name": "a", **B}
        assert source.list() == ["a", "b"]
    finally:
        source.close()


def test_a_replacement_with_the_same_rows_keeps_the_version(tmp_path: Path) -> None:
    path = write(tmp_path / "p.db", a=A)
    source = SQLitePolicySource(path)
    try:
        token = source.version()
        replace(path, a=A)  # a restore of the same content: the clients' caches stay valid
        assert source.version() == token and source.get("a") == {"name": "a", **A}
    finally:
        source.close()


def test_a_deleted_file_is_an_outage_and_is_not_created_again(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="zml.policy_sqlite")
    path = write(tmp_path / "p.db", a=A, b=B)
    source = SQLitePolicySource(path, retry_interval_s=0)  # every lookup tries the file again
    try:
        token = source.version()
        path.unlink()
        for _ in range(3):  # the snapshot read last, one warning for the outage
            assert source.version() == token
            assert source.get("a") == {"name": "a", **A} and source.list() == ["a", "b"]
        assert not path.exists()  # no empty database in its place
        (message,) = warnings(caplog)
        assert f"the file {path} no longer exists" in message and "serving the 2 policies" in message
        write(path, a=B)  # restored: read at the next lookup
        assert source.version() != token
        assert source.get("a") == {"name": "a", **B} and source.get("b") is None
        assert any("readable again" in r.getMessage() for r in caplog.records)
    finally:
        source.close()


def test_a_missing_file_is_not_created_and_is_read_once_it_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "new.db"
    # the default back-off (1 s) applies to outages, not to a file that does not exist yet
    source = SQLitePolicySource("new.db")
    try:
        assert source.version() == 0  # a client can be built
        for _ in range(2):
            with pytest.raises(zml.PolicyConfigError) as info:
                source.get("a")
            message = str(info.value)
            assert message.startswith("policy source 'sqlite:new.db' cannot look up policy 'a': "
                                      f"the database file {path} does not exist: ")
            assert f"'zml-policy-sqlite add NAME --db {path} ...'" in message
            assert f"'zml-policy-sqlite init --db {path}'" in message
            assert "or fix the path" in message and "never creates it" in message
            assert info.value.source == "sqlite:new.db" and info.value.value == str(path)
            with pytest.raises(zml.PolicyConfigError, match="cannot list policies: the database"):
                source.list()
        assert not path.exists()  # no empty database left behind by a mistyped path
        write(path, a=A)  # created by the command line: the next lookup reads it
        assert source.get("a") == {"name": "a", **A} and source.list() == ["a"]
        assert source.version() != 0
    finally:
        source.close()


def test_an_empty_database_before_the_first_policy_is_an_empty_source(tmp_path: Path) -> None:
    path = tmp_path / "empty.db"
    PolicyStore(path).close()  # `zml-policy-sqlite init`
    source = SQLitePolicySource(path)
    try:
        assert source.list() == [] and source.get("a") is None
        replace(path, a=A)
        assert source.get("a") == {"name": "a", **A}
    finally:
        source.close()


def test_a_blob_row_fails_only_its_own_lookup_naming_it(tmp_path: Path) -> None:
    import sqlite3

    path = write(tmp_path / "p.db", b=B)
    with sqlite3.connect(path) as conn:
        conn.execute("INSERT INTO zml_policies VALUES ('blob', X'ff00', 'now')")
    conn.close()
    source = SQLitePolicySource(path)
    try:
        with pytest.raises(zml.PolicyConfigError, match="'blob' is not stored as a JSON object") \
                as info:
            source.get("blob")
        assert f"zml-policy-sqlite rm blob --db {path}" in str(info.value)
        assert source.get("b") == {"name": "b", **B}
    finally:
        source.close()


# --- clients ---------------------------------------------------------------------------------


def test_running_and_new_clients_see_a_replaced_database(db: Path, config: Path) -> None:
    write(db, p=A)
    with client(config) as c:
        assert family(c, "p") == "H100"
        replace(db, p=B, q=B)
        assert family(c, "p") == "MI300X" and family(c, "q") == "MI300X"
        with client(config) as c2:
            assert family(c2, "p") == "MI300X"
        db.unlink()  # an outage: the policies read last are still served
        assert family(c, "q") == "MI300X"


def test_a_client_with_a_mistyped_database_names_it_and_creates_nothing(
    tmp_path: Path, config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    typo = tmp_path / "typo.db"
    monkeypatch.setenv("ZML_POLICY_SQLITE_DB", str(typo))
    try:
        with client(config) as c:  # a client may be built before the file exists
            assert c.infer("m", MSGS).routing.accelerator  # no policy named: routes as usual
            for name in ("fast", "prod"):  # prod is in zml.toml, but the database comes first
                with pytest.raises(zml.PolicyConfigError) as info:
                    c.infer("m", MSGS, policy=name)
                message = str(info.value)
                assert "unknown policy" not in message
                assert f"policy source 'sqlite:{typo}' cannot look up policy {name!r}: " \
                       f"ZML_POLICY_SQLITE_DB names {typo}, which does not exist: create it " \
                       f"with 'zml-policy-sqlite add NAME --db {typo} ...'" in message
                assert message.endswith("or fix the variable (the client reads the file once "
                                        "it exists, without a restart; it never creates it)")
                assert info.value.source == f"sqlite:{typo}"
            assert not typo.exists()
            # `add` from another process creates the file: the next lookup reads it
            env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
            added = subprocess.run(
                [sys.executable, "-m", "zml_policy_sqlite", "add", "fast", "--db", str(typo),
                 "--config", str(config), "--chain", "MI300X"],
                env=env, capture_output=True, text=True, timeout=60,
            )
            assert added.returncode == 0, added.stderr
            assert family(c, "fast") == "MI300X" and family(c, "prod") == "H100"
    finally:
        source_for(str(typo)).close()


def test_a_client_keeps_the_database_it_was_built_with(
    tmp_path: Path, config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tenant_a = write(tmp_path / "tenant_a.db", p=A)
    tenant_b = write(tmp_path / "tenant_b.db", p=B)
    monkeypatch.setenv("ZML_POLICY_SQLITE_DB", str(tenant_a))
    with client(config) as a:
        monkeypatch.setenv("ZML_POLICY_SQLITE_DB", str(tenant_b))
        with client(config) as b:
            assert family(a, "p") == "H100" and family(b, "p") == "MI300X"

            class Metrics:
                @zml.hookimpl
                def zml_request_completed(self) -> None:
                    pass

            a.plugins.register(Metrics(), name="metrics")  # the sources are collected again
            assert family(a, "p") == "H100"
            assert sqlite_sources(a) == [f"sqlite:{tenant_a}"]
            monkeypatch.delenv("ZML_POLICY_SQLITE_DB")
            a.plugins.unregister(name="metrics")
            assert family(a, "p") == "H100" and family(b, "p") == "MI300X"
            assert sqlite_sources(b) == [f"sqlite:{tenant_b}"]


def test_a_client_built_without_the_variable_does_not_take_it_up_later(
    tmp_path: Path, config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ZML_POLICY_SQLITE_DB", raising=False)
    with client(config) as c:
        monkeypatch.setenv("ZML_POLICY_SQLITE_DB", str(write(tmp_path / "late.db", p=A)))
        c.plugins.register(object(), name="other")
        assert sqlite_sources(c) == []
        with pytest.raises(zml.PolicyConfigError, match="unknown policy 'p'"):
            c.infer("m", MSGS, policy="p")


def test_clients_of_one_file_share_a_source_that_lives_while_one_does(
    db: Path, config: Path
) -> None:
    write(db, p=A)
    with client(config) as c1, client(config) as c2:
        (s1,) = (s for s in c1.policies.sources if isinstance(s, SQLitePolicySource))  # type: ignore[attr-defined]
        (s2,) = (s for s in c2.policies.sources if isinstance(s, SQLitePolicySource))  # type: ignore[attr-defined]
        assert s1 is s2 is source_for(str(db))
        assert family(c1, "p") == "H100"
    gone = weakref.ref(s1)
    del c1, c2, s1, s2
    gc.collect()
    assert gone() is None  # no process-wide cache keeps it, nor its connection
