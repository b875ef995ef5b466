"""The plugin, loaded through its entry point: clients use the database's policies, live."""

from __future__ import annotations

import asyncio
import os
import sqlite3
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2
import pytest

import zml
from zml_policy_sqlite import PolicyStore, SQLitePolicySource
from zml_policy_sqlite.cli import run

from .conftest import answer, locked

MSGS = [{"role": "user", "content": "hi"}]


def client(config: Path) -> zml.Client:
    return zml.Client(config=config,
                      http_client=httpx2.Client(transport=httpx2.MockTransport(answer)))


def add(db: Path, config: Path, name: str, chain: str, command: str = "add") -> None:
    assert run([command, name, "--db", str(db), "--config", str(config), "--chain", chain]) == 0


def test_loaded_through_its_entry_point(db: Path, config: Path) -> None:
    c = client(config)
    assert c.plugins.has_plugin("policy_sqlite")
    assert c.plugins.get_plugin("policy_sqlite").__name__ == "zml_policy_sqlite.plugin"
    assert any(isinstance(s, SQLitePolicySource) for s in c.policies.sources)  # type: ignore[attr-defined]


def test_without_the_variable_it_registers_nothing(
    config: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("ZML_POLICY_SQLITE_DB", raising=False)
    c = client(config)
    assert c.plugins.has_plugin("policy_sqlite")
    assert not any(isinstance(s, SQLitePolicySource) for s in c.policies.sources)  # type: ignore[attr-defined]


def test_sqlite_is_imported_only_once_a_database_is_named(db: Path, config: Path) -> None:
    # In a fresh interpreter (this test module imports sqlite3 itself): a client built without
    # the variable loads the plugin but not sqlite3; with it, the source opens the database.
    code = (f"import sys, zml\nc = zml.Client(config={str(config)!r})\n"
            "print(c.plugins.has_plugin('policy_sqlite'), 'sqlite3' in sys.modules, "
            "len(c.policies.sources))\nc.close()\n")
    env = {k: v for k, v in os.environ.items() if k != "ZML_POLICY_SQLITE_DB"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "False", "1"]  # the zml.toml tables only
    env["ZML_POLICY_SQLITE_DB"] = str(db)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "True", "2"]


def test_stored_policy_is_used_and_edits_are_seen_without_restart(
    db: Path, config: Path
) -> None:
    add(db, config, "llama", "MI300X,H100")
    with client(config) as c:
        assert c.infer("m", MSGS, policy="llama").routing.accelerator == "MI300X"
        add(db, config, "llama", "H100", command="update")
        r = c.infer("m", MSGS, policy="llama")
        assert r.routing.accelerator == "H100" and r.routing.policy == "llama"
        # a policy added after the client started (the earlier miss is not kept)
        with pytest.raises(zml.PolicyConfigError, match="unknown policy 'later'"):
            c.infer("m", MSGS, policy="later")
        add(db, config, "later", "MI300X")
        assert c.infer("m", MSGS, policy="later").routing.accelerator == "MI300X"
        assert run(["rm", "later", "--db", str(db)]) == 0
        with pytest.raises(zml.PolicyConfigError, match="unknown policy 'later'"):
            c.infer("m", MSGS, policy="later")


def test_async_client_sees_edits_too(db: Path, config: Path) -> None:
    add(db, config, "llama", "MI300X")

    async def main() -> list[str]:
        http = httpx2.AsyncClient(transport=httpx2.MockTransport(answer))
        async with zml.AsyncClient(config=config, http_client=http) as c:
            first = await c.infer("m", MSGS, policy="llama")
            add(db, config, "llama", "H100", command="update")
            second = await c.infer("m", MSGS, policy="llama")
            return [first.routing.accelerator, second.routing.accelerator]

    assert asyncio.run(main()) == ["MI300X", "H100"]


def test_requests_keep_working_while_the_database_is_locked(db: Path, config: Path) -> None:
    add(db, config, "a", "MI300X")
    add(db, config, "b", "H100")

    async def in_async_client() -> str:
        http = httpx2.AsyncClient(transport=httpx2.MockTransport(answer))
        async with zml.AsyncClient(config=config, http_client=http) as c:
            r = await asyncio.wait_for(c.infer("m", MSGS, policy="a", timeout=5), 60)
            return r.routing.accelerator

    with client(config) as c:
        assert c.infer("m", MSGS, policy="a").routing.accelerator == "MI300X"
        with locked(db):
            # "b" was never asked for: the source answers it from the snapshot it read
            with ThreadPoolExecutor(max_workers=4) as pool:
                futures = [pool.submit(c.infer, "m", MSGS, policy="ab"[i % 2], timeout=5)
                           for i in range(4)]
                got = [f.result(timeout=60).routing.accelerator for f in futures]
            assert got == ["MI300X", "H100"] * 2
            assert asyncio.run(in_async_client()) == "MI300X"


def test_a_client_built_while_the_database_is_locked_fails_only_named_lookups(
    db: Path, config: Path
) -> None:
    with PolicyStore(db) as store:  # not the command line: it builds a client, which reads
        store.add("a", {"accelerator_chain": ["MI300X"]})
    with locked(db):
        c = client(config)  # builds: the source has no snapshot yet, but does not raise
        with c, pytest.raises(zml.PolicyConfigError, match="database is locked") as info:
            c.infer("m", MSGS, policy="a", timeout=5)
    assert f"sqlite:{db}" in str(info.value)


def test_database_wins_over_zml_toml(db: Path, config: Path) -> None:
    assert run(["init", "--db", str(db)]) == 0  # an empty database: zml.toml's policies apply
    with client(config) as c:
        assert c.infer("m", MSGS, policy="prod").routing.accelerator == "H100"
        add(db, config, "prod", "MI300X")
        assert c.infer("m", MSGS, policy="prod").routing.accelerator == "MI300X"
        assert sorted(c.policies) == ["prod"]


def test_hand_edited_invalid_row_fails_with_policy_config_error(db: Path, config: Path) -> None:
    add(db, config, "p", "H100")
    with sqlite3.connect(db) as conn:
        conn.execute("UPDATE zml_policies SET fields = ? WHERE name = 'p'",
                     ('{"accelerator_chain": ["TPU"]}',))
    with client(config) as c, pytest.raises(zml.PolicyConfigError) as info:
        c.infer("m", MSGS, policy="p")
    assert f"sqlite:{db}" in str(info.value) and "'TPU'" in str(info.value)


def test_version_changes_only_on_other_connections_commits(tmp_path: Path) -> None:
    PolicyStore(tmp_path / "v.db").close()
    source = SQLitePolicySource(tmp_path / "v.db", poll_interval_s=0)
    before = source.version()
    assert source.version() == before and source.list() == []
    with sqlite3.connect(tmp_path / "v.db") as conn:
        conn.execute("INSERT INTO zml_policies VALUES ('x', '{}', 'now')")
    assert source.version() != before
    assert source.get("x") == {"name": "x"} and source.get("y") is None
    source.close()
