"""Settings from the environment; a misconfigured environment is a configuration error."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from zml_redis.settings import Settings, redact

import zml


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


def test_passwords_are_not_shown() -> None:
    assert redact("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert redact("redis://u:s3cret@h/0") == "redis://u:***@h/0"
    assert redact("redis://h:1/0") == "redis://h:1/0"
    assert "s3cret" not in Settings(url="redis://:s3cret@h:1/0").where


def test_a_bad_environment_fails_the_client_build(
    sim_fleet: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    setup = sim_fleet([{"id": "a", "family": "H100", "max_concurrency": 1}])
    monkeypatch.setenv("ZML_REDIS_URL", "redis://127.0.0.1:1/0")
    monkeypatch.setenv("ZML_REDIS_SYNC_S", "often")
    with pytest.raises(zml.PolicyConfigError, match="ZML_REDIS_SYNC_S"):
        zml.Client(config=setup.path)


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
