"""The zml-policy-sqlite command: writes are validated against the fleet before they happen."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

import zml
from zml_policy_sqlite import PolicyStore
from zml_policy_sqlite.cli import run
from zml_policy_sqlite.store import StoreError


def cli(*args: str | Path) -> int:
    return run([str(a) for a in args])


def test_add_update_list_show_rm(
    db: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("add", "fast", "--db", db, "--config", config, "--chain", "MI300X,H100",
               "--latency-target-ms", "300", "--queue-on-saturation") == 0
    assert cli("add", "batch", "--db", db, "--config", config,
               "--json", '{"accelerator_chain": ["MI300X"], "cost_priority": "cost"}') == 0
    with PolicyStore(db) as store:
        assert store.get("fast") == {"accelerator_chain": ["MI300X", "H100"],
                                     "latency_target_ms": 300.0, "queue_on_saturation": True}
    assert cli("update", "fast", "--db", db, "--config", config, "--cost-priority", "cost",
               "--unset", "latency_target_ms", "--no-queue-on-saturation") == 0
    with PolicyStore(db) as store:
        assert store.get("fast") == {"accelerator_chain": ["MI300X", "H100"],
                                     "cost_priority": "cost", "queue_on_saturation": False}
    capsys.readouterr()
    assert cli("list", "--db", db) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("batch\tMI300X\tcost_priority=cost")
    assert out[1].startswith("fast\tMI300X,H100\t")
    assert cli("list", "--db", db, "--json") == 0
    assert set(json.loads(capsys.readouterr().out)) == {"batch", "fast"}
    assert cli("show", "fast", "--db", db) == 0
    assert json.loads(capsys.readouterr().out)["name"] == "fast"
    assert cli("rm", "fast", "--db", db) == 0
    with PolicyStore(db) as store:
        assert [name for name, _ in store.items()] == ["batch"]


def test_invalid_policy_is_refused_and_nothing_is_written(
    db: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("add", "bad", "--db", db, "--config", config, "--chain", "H100,MI30X") == 1
    err = capsys.readouterr().err
    assert "accelerator_chain[1] = 'MI30X'" in err and "did you mean 'MI300X'" in err
    assert cli("add", "ok", "--db", db, "--config", config, "--chain", "H100") == 0
    assert cli("update", "ok", "--db", db, "--config", config, "--cost-priority", "cots") == 1
    assert "did you mean 'cost'" in capsys.readouterr().err
    assert cli("add", "bad2", "--db", db, "--config", config,
               "--json", '{"accelerator_chain": ["H100"], "latency_target": 5}') == 1
    assert "did you mean 'latency_target_ms'" in capsys.readouterr().err
    with PolicyStore(db) as store:
        assert store.items() == [("ok", {"accelerator_chain": ["H100"]})]


def test_store_errors(db: Path, config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli("add", "p", "--db", db, "--config", config, "--chain", "H100") == 0
    assert cli("add", "p", "--db", db, "--config", config, "--chain", "H100") == 1
    assert "already exists" in capsys.readouterr().err
    assert cli("update", "nope", "--db", db, "--config", config, "--chain", "H100") == 1
    assert cli("rm", "nope", "--db", db) == 1
    assert cli("show", "nope", "--db", db) == 1
    assert "no policy 'nope'" in capsys.readouterr().err


def test_db_defaults_to_the_environment(
    db: Path, config: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli("add", "p", "--config", config, "--chain", "H100") == 0
    assert db.exists()
    monkeypatch.delenv("ZML_POLICY_SQLITE_DB")
    with pytest.raises(SystemExit) as info:
        cli("list")
    assert info.value.code == 2
    assert "ZML_POLICY_SQLITE_DB" in capsys.readouterr().err


def test_console_script_and_module(db: Path, config: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    script = Path(sys.executable).parent / "zml-policy-sqlite"
    added = subprocess.run([str(script), "add", "p", "--db", str(db), "--config", str(config),
                            "--chain", "H100"], env=env, capture_output=True, text=True,
                           timeout=60)
    assert added.returncode == 0, added.stderr
    listed = subprocess.run([sys.executable, "-m", "zml_policy_sqlite", "list", "--db", str(db)],
                            env=env, capture_output=True, text=True, timeout=60)
    assert listed.returncode == 0, listed.stderr
    assert listed.stdout.startswith("p\tH100")


def test_unset_of_a_field_policy_lacks_is_refused_with_a_suggestion(
    db: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("add", "lt", "--db", db, "--config", config, "--chain", "H100",
               "--latency-target-ms", "300") == 0
    capsys.readouterr()
    assert cli("update", "lt", "--db", db, "--config", config,
               "--unset", "latency_target") == 1
    err = capsys.readouterr().err
    assert "--unset 'latency_target': not a Policy field; did you mean 'latency_target_ms'?" in err
    assert len(err.strip().splitlines()) == 1
    assert cli("update", "lt", "--db", db, "--config", config, "--unset", "zzz") == 1
    assert "(fields: accelerator_chain, " in capsys.readouterr().err
    assert cli("update", "lt", "--db", db, "--config", config, "--unset", "latency_target_ms",
               "--latency-target-ms", "5") == 1
    assert "also gives latency_target_ms a value" in capsys.readouterr().err
    with PolicyStore(db) as store:
        assert store.get("lt") == {"accelerator_chain": ["H100"], "latency_target_ms": 300.0}


@pytest.mark.parametrize("flags", [
    ["--latency-target-ms", "inf"],
    ["--max-queue-ms", "nan"],
    ["--health-threshold=-inf"],
    ["--latency-target-ms", "1e999"],
    ["--json", '{"latency_target_ms": Infinity}'],
])
def test_numbers_that_are_not_finite_are_refused(
    db: Path, config: Path, capsys: pytest.CaptureFixture[str], flags: list[str]
) -> None:
    assert cli("add", "p", "--db", db, "--config", config, "--chain", "H100", *flags) == 1
    err = capsys.readouterr().err
    assert "numbers must be finite (JSON has no NaN or infinity)" in err
    assert len(err.strip().splitlines()) == 1
    assert cli("add", "q", "--db", db, "--config", config, "--chain", "H100") == 0
    assert cli("update", "q", "--db", db, "--config", config, *flags) == 1
    with PolicyStore(db) as store:
        assert store.items() == [("q", {"accelerator_chain": ["H100"]})]


def test_a_stored_infinity_must_be_replaced_or_unset_by_an_update(
    db: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with PolicyStore(db) as store:
        store.add("p", {"accelerator_chain": ["H100"]})
    with sqlite3.connect(db) as conn:  # written by hand, before the command line refused it
        conn.execute("UPDATE zml_policies SET fields = ? WHERE name = 'p'",
                     ('{"accelerator_chain":["H100"],"latency_target_ms":Infinity}',))
    conn.close()
    assert cli("update", "p", "--db", db, "--config", config, "--cost-priority", "cost") == 1
    assert "latency_target_ms = inf: numbers must be finite" in capsys.readouterr().err
    assert cli("update", "p", "--db", db, "--config", config,
               "--unset", "latency_target_ms") == 0
    with PolicyStore(db) as store:
        assert store.get("p") == {"accelerator_chain": ["H100"]}


def test_the_store_refuses_to_write_what_json_cannot_hold(tmp_path: Path) -> None:
    with PolicyStore(tmp_path / "s.db") as store:
        with pytest.raises(StoreError, match="not a finite number"):
            store.add("p", {"accelerator_chain": ["H100"], "latency_target_ms": float("inf")})
        assert store.items() == []


def hand_edit(db: Path, *rows: tuple[str, object]) -> None:
    """Rows written by hand, around the command line: ``(name, fields)``."""
    with sqlite3.connect(db) as conn:
        conn.executemany("INSERT INTO zml_policies VALUES (?, ?, 'x')", rows)
    conn.close()


def test_list_shows_the_good_policies_and_reports_each_bad_row(
    db: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("add", "good", "--db", db, "--config", config, "--chain", "H100") == 0
    hand_edit(db, ("hand", "[1,2]"), ("hand2", b"\xff\x00"))
    capsys.readouterr()
    assert cli("list", "--db", db) == 1
    out, err = capsys.readouterr()
    assert out.splitlines() == ["good\tH100"]
    lines = err.splitlines()
    assert len(lines) == 2
    for name, line in zip(["hand", "hand2"], lines, strict=True):
        assert line.startswith(f"zml-policy-sqlite: error: policy {name!r}: stored fields are")
        assert str(db) in line and f"'zml-policy-sqlite rm {name} --db {db}'" in line
    assert "JSON list, not a JSON object" in lines[0]
    assert cli("list", "--db", db, "--json") == 1
    out, err = capsys.readouterr()
    assert json.loads(out) == {"good": {"accelerator_chain": ["H100"]}}
    assert len(err.splitlines()) == 2


def test_show_and_update_of_a_bad_row_name_the_policy_and_the_database(
    db: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    PolicyStore(db).close()
    hand_edit(db, ("blob", b"\xff\x00"), ("list", "[1]"))
    assert cli("show", "blob", "--db", db) == 1
    err = capsys.readouterr().err
    assert "policy 'blob': stored fields are not JSON (" in err and str(db) in err
    assert f"zml-policy-sqlite rm blob --db {db}" in err
    assert cli("update", "list", "--db", db, "--config", config, "--chain", "H100") == 1
    err = capsys.readouterr().err
    assert "policy 'list'" in err and f"zml-policy-sqlite rm list --db {db}" in err
    # the fix the message gives works
    assert cli("rm", "list", "--db", db) == 0
    assert cli("add", "list", "--db", db, "--config", config, "--chain", "H100") == 0


def test_a_database_that_cannot_be_opened_is_named_with_what_to_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = tmp_path / "text.db"
    text.write_text("not a database at all\n" * 100)
    cases = [
        (tmp_path, "it is a directory"),
        (tmp_path / "missing" / "p.db", f"the directory {str(tmp_path / 'missing')!r} does not"),
        (text, "file is not a database"),
    ]
    for path, why in cases:
        assert cli("list", "--db", path) == 1
        err = capsys.readouterr().err
        assert f"cannot open the policy database {str(path)!r}: {why}" in err, err
        assert len(err.strip().splitlines()) == 1
    with pytest.raises(StoreError, match="it is a directory") as info:
        PolicyStore(tmp_path)
    assert isinstance(info.value, zml.PolicyConfigError) and info.value.source == str(tmp_path)


@pytest.mark.parametrize("command", [
    ["list"], ["list", "--json"], ["show", "p"], ["rm", "p"],
    ["update", "p", "--chain", "H100"],
])
def test_commands_that_need_the_database_refuse_a_missing_file_and_create_nothing(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str], command: list[str]
) -> None:
    new = tmp_path / "new.db"
    extra = ["--config", str(config)] if command[0] == "update" else []
    assert cli(*command, "--db", new, *extra) == 1
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1
    assert err.startswith(f"zml-policy-sqlite: error: the policy database {str(new)!r} does "
                          "not exist (nothing was created); create it with "
                          f"'zml-policy-sqlite add NAME --db {new} ...' (or "
                          f"'zml-policy-sqlite init --db {new}' for an empty one), or fix --db")
    assert not new.exists()
    missing_dir = tmp_path / "nodir" / "p.db"
    assert cli(*command, "--db", missing_dir, *extra) == 1
    err = capsys.readouterr().err
    assert f"the directory {str(missing_dir.parent)!r} does not exist; nothing was created" in err
    assert len(err.splitlines()) == 1 and not missing_dir.parent.exists()


def test_a_missing_database_named_by_the_variable_is_refused_too(
    db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli("list") == 1
    err = capsys.readouterr().err
    assert f"the policy database {str(db)!r} does not exist" in err
    assert "or fix --db (or $ZML_POLICY_SQLITE_DB)" in err and not db.exists()


def test_the_console_script_refuses_a_missing_database_with_status_1(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    script = Path(sys.executable).parent / "zml-policy-sqlite"
    done = subprocess.run([str(script), "list", "--db", "new.db"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and done.stdout == ""
    assert done.stderr.startswith("zml-policy-sqlite: error: the policy database 'new.db' does "
                                  "not exist (nothing was created); create it with "
                                  "'zml-policy-sqlite add NAME --db new.db ...'")
    assert list(tmp_path.iterdir()) == []


def test_add_creates_the_database_and_says_so(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new = tmp_path / "new.db"
    # a refused policy creates no file either: validation comes before the file is opened
    assert cli("add", "p", "--db", new, "--config", config, "--chain", "TPU") == 1
    capsys.readouterr()
    assert not new.exists()
    assert cli("add", "p", "--db", new, "--config", config, "--chain", "H100") == 0
    assert capsys.readouterr().out == \
        f"added policy 'p' to {new} (a new database: the file did not exist)\n"
    assert cli("add", "q", "--db", new, "--config", config, "--chain", "H100") == 0
    assert capsys.readouterr().out == f"added policy 'q' to {new}\n"
    assert cli("add", "p", "--db", tmp_path / "nodir" / "p.db", "--config", config,
               "--chain", "H100") == 1
    assert "does not exist; create it first" in capsys.readouterr().err


def test_init_creates_an_empty_database_and_leaves_an_existing_one_alone(
    tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    new = tmp_path / "new.db"
    assert cli("init", "--db", new) == 0
    assert capsys.readouterr().out == f"created the policy database {new}\n"
    assert cli("list", "--db", new) == 0 and capsys.readouterr() == ("", "")
    assert cli("add", "p", "--db", new, "--config", config, "--chain", "H100") == 0
    capsys.readouterr()
    assert cli("init", "--db", new) == 0
    assert capsys.readouterr().out == \
        f"the policy database {new} exists already (1 policy); nothing to do\n"
    with PolicyStore(new) as store:
        assert store.items() == [("p", {"accelerator_chain": ["H100"]})]
    text = tmp_path / "text.db"
    text.write_text("not a database at all\n" * 100)
    assert cli("init", "--db", text) == 1
    assert "file is not a database" in capsys.readouterr().err


def test_the_store_creates_a_file_only_when_asked(tmp_path: Path) -> None:
    new = tmp_path / "new.db"
    with pytest.raises(StoreError, match="does not exist") as info:
        PolicyStore(new, create=False)
    assert isinstance(info.value, zml.PolicyConfigError) and info.value.source == str(new)
    assert not new.exists()
    with PolicyStore(new) as store:
        assert store.created
    with PolicyStore(new, create=False) as store:
        assert not store.created and store.items() == []
