"""The policy store: ``zml policies push/list/show/rm``, validation, versions, live reload."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from zml_redis.cli import load_policy_file, registry_for, validate
from zml_redis.policies import PolicyStore, RedisPolicySource
from zml_redis.settings import Settings

import zml
from tests.conftest import MODEL
from zml.cli import main

from .conftest import RedisServer

MSG = [{"role": "user", "content": "hi"}]
FAMILIES = {"H100": {"cost_per_hour": 4.0}, "MI300X": {"cost_per_hour": 3.0}}
NODES = [
    {"id": "h100-1", "family": "H100", "max_concurrency": 4,
     "sim": {"ttft_ms": 5, "tokens_per_s": 5000}},
    {"id": "mi300x-1", "family": "MI300X", "max_concurrency": 4,
     "sim": {"ttft_ms": 5, "tokens_per_s": 5000}},
]


@pytest.fixture
def fleet(sim_fleet: Callable[..., Any]) -> Any:
    return sim_fleet(NODES, {"live": {"accelerator_chain": ["MI300X"]}}, FAMILIES)


def zml_policies(settings: Settings, *args: str | Path) -> int:
    return main(["policies", *[str(a) for a in args], "--redis", settings.url,
                 "--prefix", settings.prefix])


def err_of(capsys: pytest.CaptureFixture[str]) -> str:
    """What was printed on stderr, on one line (zml's console wraps long lines)."""
    return " ".join(capsys.readouterr().err.split())


def store(settings: Settings) -> PolicyStore:
    return PolicyStore(settings.url, settings.prefix)


def test_push_list_show_rm_with_versions(
    fleet: Any, redis_env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert zml_policies(redis_env, "push", "--config", fleet.path, "--name", "fast",
                        "--chain", "MI300X,H100", "--latency-target-ms", "300",
                        "--queue-on-saturation") == 0
    toml = tmp_path / "policies.toml"
    toml.write_text('[policies.batch]\naccelerator_chain = ["H100"]\ncost_priority = "cost"\n'
                    '[policies.fast]\naccelerator_chain = ["H100"]\n')
    assert zml_policies(redis_env, "push", toml, "--config", fleet.path) == 0
    out = capsys.readouterr().out
    assert "pushed policy 'batch' (version 1)" in out and "pushed policy 'fast' (version 2)" in out
    assert "store version 2" in out
    as_json = tmp_path / "more.json"
    as_json.write_text(json.dumps({"slow": {"accelerator_chain": ["MI300X"],
                                            "max_queue_ms": 2000}}))
    assert zml_policies(redis_env, "push", as_json, "--config", fleet.path) == 0

    with store(redis_env) as s:
        snap = s.snapshot()
    assert snap.version == 3
    assert snap.versions == {"batch": 1, "fast": 2, "slow": 1}
    assert snap.policies["fast"] == {"accelerator_chain": ["H100"]}  # replaced whole
    assert snap.policies["slow"] == {"accelerator_chain": ["MI300X"], "max_queue_ms": 2000.0}

    capsys.readouterr()
    assert zml_policies(redis_env, "list") == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("store version 3")
    assert lines[1].startswith("batch\tv1\tH100\tcost_priority=cost")
    assert zml_policies(redis_env, "list", "--json") == 0
    listed = json.loads(capsys.readouterr().out)
    assert listed["version"] == 3 and listed["policies"]["fast"]["version"] == 2
    assert zml_policies(redis_env, "show", "slow") == 0
    assert json.loads(capsys.readouterr().out)["max_queue_ms"] == 2000.0

    assert zml_policies(redis_env, "rm", "slow", "nope") == 1  # all or none
    assert "no policy 'nope'" in capsys.readouterr().err
    assert zml_policies(redis_env, "rm", "slow") == 0
    with store(redis_env) as s:
        snap = s.snapshot()
    assert sorted(snap.policies) == ["batch", "fast"] and snap.version == 4
    assert zml_policies(redis_env, "push", "--config", fleet.path, "--name", "slow",
                        "--chain", "H100") == 0
    with store(redis_env) as s:
        assert s.snapshot().versions["slow"] == 3  # removal counted: versions never go back
    assert zml_policies(redis_env, "show", "gone") == 1


def test_an_invalid_push_is_refused_and_nothing_is_written(
    fleet: Any, redis_env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[good]\naccelerator_chain = ["H100"]\n[bad]\naccelerator_chain = ["MI30X"]\n')
    assert zml_policies(redis_env, "push", bad, "--config", fleet.path) == 2
    err = err_of(capsys)
    assert "PolicyConfigError" in err and "'MI30X'" in err and "did you mean 'MI300X'" in err
    assert zml_policies(redis_env, "push", "--config", fleet.path, "--name", "p",
                        "--chain", "H100", "--cost-priority", "cots") == 2
    assert "did you mean 'cost'" in err_of(capsys)
    monkeypatch.setenv("ZML_CONFIG", str(fleet.path))  # the registry of $ZML_CONFIG
    assert zml_policies(redis_env, "push", "--name", "p", "--json",
                        '{"accelerator_chain": ["H100"], "latency_target": 5}') == 2
    assert "did you mean 'latency_target_ms'" in err_of(capsys)
    with store(redis_env) as s:
        snap = s.snapshot()
    assert snap.version == 0 and snap.policies == {}  # nothing written, not even 'good'

    registry = registry_for(str(fleet.path))
    with pytest.raises(zml.PolicyConfigError) as info:
        validate(load_policy_file(bad), registry, str(bad))
    assert info.value.field == "accelerator_chain" and info.value.suggestion == "MI300X"
    assert zml_policies(redis_env, "push", tmp_path / "missing.toml") == 1
    assert zml_policies(redis_env, "push", bad, "--name", "x") == 1  # FILE or flags


def test_a_pushed_policy_is_used_by_a_running_client_within_a_second(
    fleet: Any, redis_env: Settings, capsys: pytest.CaptureFixture[str]
) -> None:
    with zml.Client(config=fleet.path) as client:
        source = next(s for s in client.policies.sources if isinstance(s, RedisPolicySource))
        assert source.hub.subscribed.wait(5)

        def accelerator() -> str:
            return client.infer(model=MODEL, messages=MSG, policy="live",
                                max_tokens=2).routing.accelerator

        assert accelerator() == "MI300X"  # zml.toml's [policies.live]: nothing in Redis yet
        delays = []
        for chain in ("H100", "MI300X", "H100"):
            assert zml_policies(redis_env, "push", "--config", fleet.path, "--name", "live",
                                "--chain", chain) == 0
            pushed = time.monotonic()
            while accelerator() != chain:
                assert time.monotonic() - pushed < 1.0, "the client did not switch within 1 s"
            delays.append(time.monotonic() - pushed)
        assert source.versions()["live"] == 3
        assert zml_policies(redis_env, "rm", "live") == 0
        removed = time.monotonic()
        while accelerator() != "MI300X":  # back to zml.toml's
            assert time.monotonic() - removed < 1.0
        with capsys.disabled():
            print(f"\n  pushed policy in use after {', '.join(f'{d * 1e3:.1f}' for d in delays)}"
                  " ms")


def test_store_and_source_without_the_cli(redis_env: Settings, redis_server: RedisServer) -> None:
    with store(redis_env) as s:
        version, versions = s.push({"a": {"accelerator_chain": ["H100"]}})
        assert (version, versions) == (1, {"a": 1})
    r = redis_server.client()
    r.hset(redis_env.policies_key, "broken", "not json")
    from zml_redis.hubs import hub_for

    source = RedisPolicySource(hub_for(redis_env))
    assert source.list() == ["a", "broken"]
    assert source.get("a") == {"accelerator_chain": ["H100"], "name": "a"}
    assert source.get("zzz") is None
    calls: list[int] = []
    source.subscribe(lambda: calls.append(1))
    with store(redis_env) as s:
        s.push({"b": {"accelerator_chain": ["H100"]}})
    deadline = time.monotonic() + 2
    while not calls and time.monotonic() < deadline:
        time.sleep(0.01)
    assert calls and "b" in source.list()


def test_a_hand_edited_bad_row_fails_the_request_that_names_it(
    fleet: Any, redis_env: Settings, redis_server: RedisServer
) -> None:
    redis_server.client().hset(redis_env.policies_key, "live", "[1, 2]")
    with zml.Client(config=fleet.path) as client, pytest.raises(zml.PolicyConfigError) as info:
        client.infer(model=MODEL, messages=MSG, policy="live")
    assert "not a JSON object" in str(info.value)


@pytest.mark.parametrize(("url", "problem"), [
    ("redis://u:SECRETPW@127.0.0.1:99999/0", "no valid host:port"),
    ("redis://u:SEC#RETPW@127.0.0.1:6379/0", "contains '#'"),
    ("http://127.0.0.1:6379", "is not a redis://"),
    ("redis://:SECRETPW@127.0.0.1:6379/0?socket_timeout=abc", "'socket_timeout'"),
])
def test_a_malformed_redis_url_is_one_line_without_its_password(
    url: str, problem: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["policies", "list", "--redis", url]) == 2
    err = capsys.readouterr().err
    assert err.startswith("zml policies: error: --redis=") and problem in err, err
    assert len(err.strip().splitlines()) == 1 and "SEC" not in err, err


def test_an_unreachable_redis_is_one_line_without_a_query_string_password(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from .conftest import free_port

    monkeypatch.setenv("ZML_REDIS_URL", f"redis://127.0.0.1:{free_port()}/0?password=S3CRETPW")
    assert main(["policies", "list"]) == 1
    err = capsys.readouterr().err
    assert "password=***" in err and "ConnectionError" in err, err
    assert len(err.strip().splitlines()) == 1 and "S3CRETPW" not in err, err


def test_a_push_file_that_is_not_utf8_is_one_line(
    fleet: Any, redis_env: Settings, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "latin1.toml"
    bad.write_bytes('[p]\naccelerator_chain = ["H100"]\n# café\n'.encode("latin-1"))
    assert zml_policies(redis_env, "push", bad, "--config", fleet.path) == 1
    err = capsys.readouterr().err
    assert "not UTF-8 text" in err and len(err.strip().splitlines()) == 1, err


CORRUPTIONS = [  # (what is written by hand, the key named)
    (("set", "{p}:policies:version", "abc"), "{p}:policies:version"),
    (("hset", "{p}:policies:versions", "a", "1.5"), "{p}:policies:versions"),
    (("set", "{p}:policies", "x"), "{p}:policies"),
    (("hset", "{p}:policies:version", "f", "1"), "{p}:policies:version"),
]


@pytest.mark.parametrize(("edit", "key"), CORRUPTIONS)
def test_a_store_edited_by_hand_is_a_typed_error_naming_the_key(
    fleet: Any, redis_env: Settings, redis_server: RedisServer,
    capsys: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture,
    edit: tuple[str, ...], key: str,
) -> None:
    r = redis_server.client()
    if edit[1] != "{p}:policies":
        r.hset(redis_env.policies_key, "a", '{"accelerator_chain": ["H100"]}')
    key = key.replace("{p}", redis_env.prefix)
    getattr(r, edit[0])(*[a.replace("{p}", redis_env.prefix) for a in edit[1:]])
    before = contents(r, redis_env.prefix)

    with pytest.raises(zml.PolicyConfigError) as info:
        zml.Client(config=fleet.path)
    assert info.value.field == key and key in str(info.value)
    assert not any("unreachable" in rec.getMessage() for rec in caplog.records)

    capsys.readouterr()
    assert zml_policies(redis_env, "list") == 1
    err = capsys.readouterr().err
    assert key in err and len(err.strip().splitlines()) == 1, err
    assert zml_policies(redis_env, "push", "--config", fleet.path, "--name", "a",
                        "--chain", "MI300X") == 1
    assert key in err_of(capsys)
    assert zml_policies(redis_env, "rm", "a") == 1
    assert key in err_of(capsys)
    assert contents(r, redis_env.prefix) == before  # nothing written, not even in part


def contents(r: Any, prefix: str) -> dict[str, Any]:
    """Every key of the prefix with its value (strings and hashes)."""
    return {k: r.get(k) if r.type(k) == "string" else r.hgetall(k)
            for k in r.keys(f"{prefix}:*")}


def test_a_store_edited_by_hand_under_a_running_client_keeps_its_policies(
    fleet: Any, redis_env: Settings, redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    with store(redis_env) as s:
        s.push({"a": {"accelerator_chain": ["H100"]}})
    with zml.Client(config=fleet.path) as client:
        source = next(s for s in client.policies.sources if isinstance(s, RedisPolicySource))
        assert source.hub.subscribed.wait(5)
        r = redis_server.client()
        r.set(redis_env.store_version_key, "abc")
        r.publish(redis_env.policies_channel, "{}")  # what a push would announce
        deadline = time.monotonic() + 5
        while not any(redis_env.store_version_key in m.getMessage() for m in caplog.records):
            assert time.monotonic() < deadline, "no warning about the corrupt key"
            time.sleep(0.01)
        assert source.list() == ["a"] and source.hub.connected
        assert client.infer(model=MODEL, messages=MSG, policy="a",
                            max_tokens=2).routing.accelerator == "H100"
        r.set(redis_env.store_version_key, "7")  # repaired: read again at the next change
        with store(redis_env) as s:
            s.push({"b": {"accelerator_chain": ["MI300X"]}})
        deadline = time.monotonic() + 5
        while source.list() != ["a", "b"]:
            assert time.monotonic() < deadline, source.list()
            time.sleep(0.01)
        assert source.version == 8
    assert not any("unreachable" in m.getMessage() or "failed" in m.getMessage()
                   for m in caplog.records if m.name == "zml.redis")
