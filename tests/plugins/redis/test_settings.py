"""Settings from the environment; a misconfigured environment is a configuration error."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from zml_redis import RedisLedger
from zml_redis.settings import (
    LEASE_TTL_MAX_S,
    SYNC_MAX_S,
    TIMEOUT_MAX_MS,
    URL_TIMEOUT_MAX_S,
    Settings,
    SettingsError,
    redact,
)

import zml

from .conftest import RedisServer


def test_defaults_and_overrides() -> None:
    assert Settings.from_env({}) is None
    assert Settings.from_env({"ZML_REDIS_URL": "  "}) is None
    s = Settings.from_env({"ZML_REDIS_URL": "redis://h:6379/1"})
    assert s == Settings(url="redis://h:6379/1")
    assert (s.prefix, s.lease_ttl_s, s.timeout_s, s.sync_s, s.ledger) == ("zml", 10.0, 0.1,
                                                                          0.5, True)
    assert s.renew_s == pytest.approx(10 / 3)
    assert s.lease_key("n-1") == "zml:lease:n-1"
    s = Settings.from_env({"ZML_REDIS_URL": "rediss://h", "ZML_REDIS_PREFIX": "blue",
                           "ZML_REDIS_LEASE_TTL_S": "2", "ZML_REDIS_TIMEOUT_MS": "50",
                           "ZML_REDIS_SYNC_S": "1", "ZML_REDIS_LEDGER": "0"})
    assert s is not None
    assert (s.prefix, s.lease_ttl_ms, s.timeout_s, s.sync_s, s.ledger) == ("blue", 2000, 0.05,
                                                                           1.0, False)
    assert s.policies_channel == "blue:policies:changed"


@pytest.mark.parametrize(("env", "message"), [
    ({"ZML_REDIS_URL": "http://h"}, "is not a redis://"),
    ({"ZML_REDIS_URL": "redis://h", "ZML_REDIS_LEASE_TTL_S": "soon"}, "is not a number"),
    ({"ZML_REDIS_URL": "redis://h", "ZML_REDIS_TIMEOUT_MS": "0"}, "must be at least"),
])
def test_bad_values_are_refused(env: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Settings.from_env(env)


@pytest.mark.parametrize("name", ["ZML_REDIS_LEASE_TTL_S", "ZML_REDIS_TIMEOUT_MS",
                                  "ZML_REDIS_SYNC_S"])
@pytest.mark.parametrize("raw", ["nan", "inf", "-inf", "NaN"])
def test_numbers_that_are_not_finite_are_refused(name: str, raw: str) -> None:
    with pytest.raises(SettingsError, match=f"{name}=.* must be a finite number") as info:
        Settings.from_env({"ZML_REDIS_URL": "redis://h:1/0", name: raw})
    assert isinstance(info.value, zml.PolicyConfigError) and info.value.field == name


RANGES = {  # variable: its accepted range as messages and docs show it, and its default
    "ZML_REDIS_LEASE_TTL_S": ("from 0.2 to 3600 s", "10"),
    "ZML_REDIS_TIMEOUT_MS": ("from 1 to 2000 ms", "100"),
    "ZML_REDIS_SYNC_S": ("from 0.01 to 60 s", "0.5"),
}


@pytest.mark.parametrize(("name", "raw", "problem"), [
    ("ZML_REDIS_TIMEOUT_MS", "1e12", "must be at most 2000 ms"),
    ("ZML_REDIS_TIMEOUT_MS", "2000.5", "must be at most 2000 ms"),
    ("ZML_REDIS_TIMEOUT_MS", "0.999", "must be at least 1 ms"),
    ("ZML_REDIS_TIMEOUT_MS", "-5", "must be at least 1 ms"),
    ("ZML_REDIS_LEASE_TTL_S", "1e15", "must be at most 3600 s"),
    ("ZML_REDIS_LEASE_TTL_S", "3600.001", "must be at most 3600 s"),
    ("ZML_REDIS_LEASE_TTL_S", "0.19", "must be at least 0.2 s"),
    ("ZML_REDIS_SYNC_S", "1e9", "must be at most 60 s"),
    ("ZML_REDIS_SYNC_S", "60.01", "must be at most 60 s"),
    ("ZML_REDIS_SYNC_S", "0.009", "must be at least 0.01 s"),
])
def test_numbers_out_of_their_range_are_refused(name: str, raw: str, problem: str) -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"ZML_REDIS_URL": "redis://h:1/0", name: raw})
    message = str(info.value)
    allowed, default = RANGES[name]
    # The variable and the value, what is wrong, the range, and the fix:
    assert message.startswith(f"{name}={raw!r} {problem}"), message
    assert f"set it to a number {allowed}, or unset it for the default ({default})" in message
    assert isinstance(info.value, zml.PolicyConfigError)
    assert (info.value.field, info.value.value) == (name, raw)


@pytest.mark.parametrize(("name", "raw", "attribute", "value"), [
    ("ZML_REDIS_LEASE_TTL_S", "0.2", "lease_ttl_ms", 200),
    ("ZML_REDIS_LEASE_TTL_S", "3600", "lease_ttl_ms", 3_600_000),
    ("ZML_REDIS_TIMEOUT_MS", "1", "timeout_s", 0.001),
    ("ZML_REDIS_TIMEOUT_MS", "2000", "timeout_s", 2.0),
    ("ZML_REDIS_SYNC_S", "0.01", "sync_s", 0.01),
    ("ZML_REDIS_SYNC_S", "60", "sync_s", 60.0),
])
def test_the_ends_of_each_range_are_accepted(
    name: str, raw: str, attribute: str, value: float
) -> None:
    settings = Settings.from_env({"ZML_REDIS_URL": "redis://h:1/0", name: raw})
    assert settings is not None and getattr(settings, attribute) == value


def test_the_documented_ranges_are_the_enforced_ones() -> None:
    import zml_redis.settings as module
    from zml_redis.hub import BACKGROUND_TIMEOUT_S

    # No request waits on Redis longer than the plugin's own background commands do.
    assert TIMEOUT_MAX_MS / 1000 == BACKGROUND_TIMEOUT_S
    readme = (Path(module.__file__).parents[2] / "README.md").read_text()
    rows = {line.split("|")[1].strip(" `"): line.split("|")[3].strip()
            for line in readme.splitlines() if line.startswith("| `ZML_REDIS_")}
    doc = module.__doc__ or ""
    for name, (allowed, _) in RANGES.items():
        low, high = allowed.removeprefix("from ").split()[0::2]
        assert rows[name] == f"{low} to {high}", rows
        assert f"``{name}``" in doc and f" {low}-{high} " in doc, name
    assert (LEASE_TTL_MAX_S, SYNC_MAX_S, URL_TIMEOUT_MAX_S) == (3600, 60, 60)


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("lease_ttl_s", 1e15, "must be at most 3600"),
    ("lease_ttl_s", 0.0, "must be at least 0.2"),
    ("timeout_s", 1e6, "must be at most 2"),
    ("timeout_s", 0.0001, "must be at least 0.001"),
    ("sync_s", float("nan"), "must be a finite number"),
    ("sync_s", float("inf"), "must be a finite number"),
    ("sync_s", "1", "is not a number"),
    ("lease_ttl_s", True, "is not a number"),
    ("prefix", "", "is not a non-empty string"),
    ("prefix", None, "is not a non-empty string"),
    ("ledger", "no", "is not a bool"),
])
def test_settings_built_in_code_are_held_to_the_same_ranges(
    field: str, value: object, problem: str
) -> None:
    with pytest.raises(SettingsError, match=f"Settings\\({field}=.*\\) {problem}") as info:
        Settings(url="redis://:SECRETPW@h:1/0", **{field: value})  # type: ignore[arg-type]
    assert info.value.field == field
    assert isinstance(info.value, zml.PolicyConfigError)
    assert "SECRETPW" not in str(info.value)


def test_settings_built_in_code_accept_the_ends_of_each_range() -> None:
    low = Settings(url="redis://h:1/0", lease_ttl_s=0.2, timeout_s=0.001, sync_s=0.01)
    high = Settings(url="redis://h:1/0", lease_ttl_s=3600, timeout_s=2, sync_s=60)
    assert (low.lease_ttl_ms, high.lease_ttl_ms) == (200, 3_600_000)


@pytest.mark.parametrize("url", [b"redis://h:1/0", "http://:SECRETPW@h:1", "redis://h:0/0"])
def test_settings_built_in_code_check_the_url(url: object) -> None:
    with pytest.raises(SettingsError) as info:
        Settings(url=url)  # type: ignore[arg-type]
    assert info.value.field == "url" and "SECRETPW" not in str(info.value)


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), 1e12, "2", True])
def test_a_policy_store_timeout_out_of_range_is_refused(timeout_s: object) -> None:
    from zml_redis import PolicyStore

    with pytest.raises(SettingsError, match=r"PolicyStore\(timeout_s=.*\) is not a number of "
                                            "seconds above 0 and at most 60") as info:
        PolicyStore("redis://h:1/0", timeout_s=timeout_s)  # type: ignore[arg-type]
    assert info.value.field == "timeout_s"


@pytest.mark.parametrize("query", ["socket_timeout=1e12", "socket_timeout=60.5",
                                   "socket_connect_timeout=1e15"])
def test_a_url_timeout_beyond_a_minute_is_refused(query: str) -> None:
    url = f"redis://:SECRETPW@127.0.0.1:6379/0?{query}"
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"ZML_REDIS_URL": url})
    message = str(info.value)
    assert message.startswith("ZML_REDIS_URL=") and "SEC" not in message, message
    assert "above 0 and at most 60" in message and "leave it out" in message, message


@pytest.mark.parametrize("query", ["socket_timeout=60", "socket_connect_timeout=60",
                                   "socket_timeout=0.001"])
def test_a_url_timeout_of_up_to_a_minute_is_accepted(query: str) -> None:
    assert Settings.from_env({"ZML_REDIS_URL": f"redis://127.0.0.1:6379/0?{query}"})


def test_the_longest_settings_work_against_a_real_redis(
    sim_fleet: Callable[..., Any], redis_env: Settings, redis_server: RedisServer,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Each upper end is within what Redis (PEXPIRE of 3 TTLs, ZADD scores) and sockets take.
    setup = sim_fleet([{"id": "a", "family": "H100", "max_concurrency": 1}])
    monkeypatch.setenv("ZML_REDIS_URL", f"{redis_server.url}?socket_timeout=60")
    monkeypatch.setenv("ZML_REDIS_LEASE_TTL_S", "3600")
    monkeypatch.setenv("ZML_REDIS_TIMEOUT_MS", "2000")
    monkeypatch.setenv("ZML_REDIS_SYNC_S", "60")
    with zml.Client(config=setup.path) as client:
        ledger = client.fleet.ledger
        assert isinstance(ledger, RedisLedger) and ledger.hub.settings.lease_ttl_s == 3600
        node = client.fleet.node("a")
        assert ledger.acquire(node, "longest") and ledger.hub.connected
        r = redis_server.client()
        key = redis_env.lease_key("a")
        assert 3 * 3_600_000 - 60_000 < r.pttl(key) <= 3 * 3_600_000
        expiry = r.zscore(key, "longest")
        assert expiry is not None and expiry - r.time()[0] * 1000 > 3_600_000 - 60_000
        ledger.release(node, "longest")
        deadline = time.monotonic() + 2.0
        while r.zcard(key) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.zcard(key) == 0


@pytest.mark.parametrize(("url", "problem"), [
    ("redis://u:SECRETPW@127.0.0.1:99999/0", "no valid host:port"),
    ("redis://u:SEC#RETPW@127.0.0.1:6379/0", "contains '#'"),
    ("redis://u:SEC/RETPW@127.0.0.1:6379/0", "no valid host:port"),
    ("redis://u:12/SECRETPW@127.0.0.1:6379/0", "an '@' after the host"),
    ("redis://:SECRETPW@127.0.0.1:6379/0?socket_timeout=abc", "'socket_timeout'"),
    ("redis://:SECRETPW@127.0.0.1:6379/0?socket_timeout=inf", "finite number of seconds"),
    ("redis://:SECRETPW@127.0.0.1:6379/0?sockt_timeout=1", "'sockt_timeout'"),
    ("redis://:SECRETPW@127.0.0.1:6379/zero", "database number"),
    ("redis://:SECRETPW@127.0.0.1:0/0", "port 0"),
    ("unix:///run/redis.sock?password=SECRETPW&db=x", "'db'"),
    ("http://:SECRETPW@127.0.0.1:6379", "is not a redis://"),
])
def test_a_malformed_url_is_refused_without_its_password(url: str, problem: str) -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"ZML_REDIS_URL": url})
    message = str(info.value)
    assert message.startswith("ZML_REDIS_URL=") and problem in message, message
    assert "SEC" not in message and "SEC" not in str(info.value.value), message
    assert isinstance(info.value, zml.PolicyConfigError) and info.value.field == "ZML_REDIS_URL"


def test_passwords_are_not_shown() -> None:
    assert redact("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert redact("redis://u:s3cret@h/0") == "redis://u:***@h/0"
    assert redact("redis://h:1/0") == "redis://h:1/0"
    assert redact("redis://u:s3cret@[::1]:6379/0") == "redis://u:***@[::1]:6379/0"
    assert "s3cret" not in Settings(url="redis://:s3cret@h:1/0").where


def test_passwords_in_the_query_string_are_not_shown() -> None:
    assert (redact("unix:///nonexistent.sock?db=0&password=S3CRETPW")
            == "unix:///nonexistent.sock?db=0&password=***")
    assert (redact("redis://h:1/0?Password=a&auth_token=b&client_secret=c&ssl_pass=d&db=2")
            == "redis://h:1/0?Password=***&auth_token=***&client_secret=***&ssl_pass=***&db=2")
    assert redact("rediss://u:pw@h/0?ssl_password=x%20y") == "rediss://u:***@h/0?ssl_password=***"


@pytest.mark.parametrize("url", [
    "redis://u:SEC#RETPW@h:6379/0", "redis://u:SEC/RETPW@h:6379/0", "redis://u:12/SECRET@h/0",
    "redis://u:SEC?RETPW@h:6379/0", "redis://:SECRETPW@h:99999/0", "u:SECRETPW@h:6379",
    "redis://h/0?password=SEC#RET",
])
def test_a_url_that_does_not_parse_cleanly_loses_everything_a_password_could_be(
    url: str,
) -> None:
    shown = redact(url)
    assert "SEC" not in shown and "RET" not in shown, shown
    assert "h" in shown


def test_the_settings_repr_shows_the_url_without_its_password() -> None:
    settings = Settings.from_env({"ZML_REDIS_URL": "redis://default:S3CRETPW@127.0.0.1:6379/0"})
    assert repr(settings) == ("Settings(url='redis://default:***@127.0.0.1:6379/0', "
                              "prefix='zml', lease_ttl_s=10.0, timeout_s=0.1, sync_s=0.5, "
                              "ledger=True)")
    assert "S3CRETPW" not in repr(Settings(url="unix:///s.sock?password=S3CRETPW"))


def test_a_bad_environment_fails_the_client_build(
    sim_fleet: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    setup = sim_fleet([{"id": "a", "family": "H100", "max_concurrency": 1}])
    monkeypatch.setenv("ZML_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("ZML_REDIS_SYNC_S", "often")
    with pytest.raises(zml.PolicyConfigError, match="ZML_REDIS_SYNC_S"):
        zml.Client(config=setup.path)


@pytest.mark.parametrize(("name", "value"), [
    ("ZML_REDIS_URL", "redis://u:SECRETPW@127.0.0.1:99999/0"),
    ("ZML_REDIS_URL", "redis://u:SEC#RETPW@127.0.0.1:6379/0"),
    ("ZML_REDIS_URL", "redis://:SECRETPW@127.0.0.1:6379/0?socket_timeout=abc"),
    ("ZML_REDIS_LEASE_TTL_S", "nan"),
    ("ZML_REDIS_TIMEOUT_MS", "inf"),
    ("ZML_REDIS_TIMEOUT_MS", "1e12"),
    ("ZML_REDIS_LEASE_TTL_S", "1e15"),
    ("ZML_REDIS_SYNC_S", "1e9"),
    ("ZML_REDIS_URL", "redis://:SECRETPW@127.0.0.1:6379/0?socket_timeout=1e12"),
])
def test_a_malformed_value_fails_the_client_build_with_a_typed_error(
    sim_fleet: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, name: str, value: str,
) -> None:
    setup = sim_fleet([{"id": "a", "family": "H100", "max_concurrency": 1}])
    monkeypatch.setenv("ZML_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv(name, value)
    with pytest.raises(zml.PolicyConfigError) as info:
        zml.Client(config=setup.path)
    assert str(info.value).startswith(f"zml-redis: {name}=") and info.value.field == name
    assert "SEC" not in str(info.value)


def test_the_unreachable_warning_does_not_show_a_query_string_password(
    sim_fleet: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture, tmp_path: Any,
) -> None:
    setup = sim_fleet([{"id": "a", "family": "H100", "max_concurrency": 1}])
    monkeypatch.setenv("ZML_REDIS_URL", f"unix://{tmp_path}/none.sock?db=0&password=S3CRETPW")
    caplog.set_level(logging.WARNING, logger="zml.redis")
    with zml.Client(config=setup.path) as client:
        assert client.fleet.ledger is not None
    warnings = [r.getMessage() for r in caplog.records if r.name == "zml.redis"]
    assert any("unreachable" in m and "password=***" in m for m in warnings), warnings
    assert not any("S3CRETPW" in m for m in warnings), warnings


def test_without_the_url_the_settings_are_not_even_imported(tmp_path: Any) -> None:
    # In a fresh interpreter (this module imports the settings itself): the plugin is loaded
    # and does nothing; its settings module is left for a process that names a Redis.
    import os
    import subprocess
    import sys

    config = tmp_path / "zml.toml"
    config.write_text('[accelerators.H100]\n[policies.p]\naccelerator_chain = ["H100"]\n')
    code = (f"import sys, zml\nc = zml.Client(config={str(config)!r})\n"
            "print(c.plugins.has_plugin('redis'), 'zml_redis.settings' in sys.modules, "
            "c.fleet.ledger is None)\nc.close()\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ZML_REDIS")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.split() == ["True", "False", "True"]


@pytest.mark.parametrize(("raw", "ledger"), [
    ("1", True), ("true", True), ("yes", True), ("on", True), ("TRUE", True), (" On ", True),
    ("0", False), ("false", False), ("no", False), ("off", False), ("OFF", False),
    ("False", False), ("", True), ("  ", True),
])
def test_the_ledger_switch_takes_its_documented_spellings(raw: str, ledger: bool) -> None:
    settings = Settings.from_env({"ZML_REDIS_URL": "redis://h:1/0", "ZML_REDIS_LEDGER": raw})
    assert settings is not None and settings.ledger is ledger


@pytest.mark.parametrize("raw", ["flase", "disabled", "none", "2", "yes please", "O", "-1",
                                 "enable"])
def test_a_ledger_switch_that_is_neither_on_nor_off_is_refused(raw: str) -> None:
    with pytest.raises(SettingsError) as info:
        Settings.from_env({"ZML_REDIS_URL": "redis://h:1/0", "ZML_REDIS_LEDGER": raw})
    message = str(info.value)
    assert message.startswith(f"ZML_REDIS_LEDGER={raw.strip()!r} "), message
    for accepted in ("1, true, yes, on", "0, false, no, off"):
        assert accepted in message, message
    assert isinstance(info.value, zml.PolicyConfigError)
    assert (info.value.field, info.value.value) == ("ZML_REDIS_LEDGER", raw.strip())


def test_a_ledger_switch_that_is_neither_on_nor_off_fails_the_client_build(
    sim_fleet: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    setup = sim_fleet([{"id": "a", "family": "H100", "max_concurrency": 1}])
    monkeypatch.setenv("ZML_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("ZML_REDIS_LEDGER", "flase")
    with pytest.raises(SettingsError) as info:
        zml.Client(config=setup.path)
    assert str(info.value).startswith("zml-redis: ZML_REDIS_LEDGER='flase' is neither on nor off")
    assert info.value.field == "ZML_REDIS_LEDGER"
