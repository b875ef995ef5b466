"""Policy sources: precedence, live changes, validation, and cheap lookups."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import pytest

import zml
from zml.plugins.policy_sources import SourcePolicies

from .conftest import Driver, Nodes


class DictSource:
    """A policy source over a dict; ``version()`` counts edits, ``reads`` counts get()s."""

    def __init__(self, policies: dict[str, Any], name: str = "dict", versioned: bool = True):
        self.policies = policies
        self.name = name
        self.edits = 0
        self.reads = 0
        if not versioned:
            self.version = None  # type: ignore[assignment]

    def get(self, name: str) -> Mapping[str, Any] | None:
        self.reads += 1
        return self.policies.get(name)

    def list(self) -> list[str]:
        return list(self.policies)

    def version(self) -> int:
        return self.edits

    def edit(self, name: str, fields: dict[str, Any]) -> None:
        self.policies[name] = fields
        self.edits += 1


class SourcePlugin:
    def __init__(self, *sources: Any) -> None:
        self.sources = sources

    @zml.hookimpl
    def zml_register_policy_sources(self, register: Callable[[Any], None]) -> None:
        for source in self.sources:
            register(source)


def test_plugin_source_wins_over_toml_and_toml_fills_in(driver: Driver) -> None:
    source = DictSource({"prod": {"accelerator_chain": ["MI300X"]}})
    driver.plugins.register(SourcePlugin(source), name="dict-policies")
    assert driver.infer(policy="prod").routing.accelerator == "MI300X"
    assert driver.infer(policy="h100only").routing.accelerator == "H100"  # zml.toml's
    assert list(driver.client.policies) == ["prod", "h100only", "cheap"]
    assert driver.client.policies["prod"].accelerator_chain == ("MI300X",)


def test_first_registered_source_of_a_plugin_wins_and_later_plugins_come_first(
    driver: Driver,
) -> None:
    first = DictSource({"x": {"accelerator_chain": ["MI300X"]}}, name="first")
    second = DictSource({"x": {"accelerator_chain": ["A10"]}}, name="second")
    driver.plugins.register(SourcePlugin(first, second), name="one")
    assert driver.client.policies["x"].accelerator_chain == ("MI300X",)
    later = DictSource({"x": {"accelerator_chain": ["H100"]}}, name="later")
    driver.plugins.register(SourcePlugin(later), name="two")
    assert driver.client.policies["x"].accelerator_chain == ("H100",)
    driver.plugins.unregister(name="two")
    assert driver.client.policies["x"].accelerator_chain == ("MI300X",)


def test_edit_is_seen_without_restart_and_lookups_are_cached(driver: Driver) -> None:
    source = DictSource({"live": {"accelerator_chain": ["H100"]}})
    driver.plugins.register(SourcePlugin(source), name="dict-policies")
    assert driver.infer(policy="live").routing.accelerator == "H100"
    reads = source.reads
    for _ in range(5):
        driver.infer(policy="live")
    assert source.reads == reads  # cached while the version does not change
    source.edit("live", {"accelerator_chain": ["MI300X"]})
    assert driver.infer(policy="live").routing.accelerator == "MI300X"
    source.edit("new-one", {"accelerator_chain": ["A10"]})
    assert driver.infer(policy="new-one").routing.accelerator == "A10"


def test_subscribe_notifies_change(driver: Driver) -> None:
    class Pushing(DictSource):
        def __init__(self) -> None:
            super().__init__({"p": {"accelerator_chain": ["H100"]}}, versioned=False)
            self.callbacks: list[Callable[[], None]] = []

        def subscribe(self, callback: Callable[[], None]) -> None:
            self.callbacks.append(callback)

    source = Pushing()
    driver.plugins.register(SourcePlugin(source), name="pushing")
    assert driver.client.policies["p"].accelerator_chain == ("H100",)
    source.policies["p"] = {"accelerator_chain": ["MI300X"]}
    assert driver.client.policies["p"].accelerator_chain == ("H100",)  # not told yet
    worker = threading.Thread(target=lambda: [cb() for cb in source.callbacks])
    worker.start()
    worker.join()
    assert driver.client.policies["p"].accelerator_chain == ("MI300X",)


def test_invalid_policy_from_a_source_is_a_policy_config_error(driver: Driver) -> None:
    source = DictSource({"typo": {"accelerator_chain": ["H10"]},
                         "badfield": {"accelerator_chain": ["H100"], "cost_priorty": "cost"},
                         "notadict": 42},
                        name="my-store")
    driver.plugins.register(SourcePlugin(source), name="bad-policies")
    with pytest.raises(zml.PolicyConfigError) as info:
        driver.infer(policy="typo")
    assert "my-store" in str(info.value) and "'H10'" in str(info.value)
    assert info.value.suggestion == "H100" and info.value.source == "my-store"
    with pytest.raises(zml.PolicyConfigError, match="did you mean 'cost_priority'"):
        driver.infer(policy="badfield")
    with pytest.raises(zml.PolicyConfigError, match="my-store"):
        driver.infer(policy="notadict")
    source.edit("typo", {"accelerator_chain": ["H100"]})  # a fix is seen at once
    assert driver.infer(policy="typo").routing.accelerator == "H100"


def test_a_failing_source_is_reported_as_a_config_error(driver: Driver) -> None:
    class Down(DictSource):
        def get(self, name: str) -> Any:
            raise OSError("store unreachable")

    driver.plugins.register(SourcePlugin(Down({}, name="down")), name="down")
    with pytest.raises(zml.PolicyConfigError, match=r"'down' failed .*store unreachable"):
        driver.infer(policy="prod")


def test_a_source_s_own_config_error_reaches_the_caller_whole(config: Path) -> None:
    """Wrapped twice and cut at 300 characters, its advice was lost (`zml policy check` with a
    mistyped ZML_POLICY_SQLITE_DB ended in "... or f...")."""
    advice = "x" * 300 + ": fix the variable, or unset it"

    class Refusing(DictSource):
        def list(self) -> list[str]:
            raise zml.PolicyConfigError(f"the store path is not a database {advice}")

    client = zml.Client(config=config)
    client.plugins.register(SourcePlugin(Refusing({}, name="sqlite")), name="sqlite")
    with pytest.raises(zml.PolicyConfigError) as info:
        list(client.policies)
    message = str(info.value)
    assert message.startswith("policy source 'sqlite' failed to list its policies: the store")
    assert message.endswith("fix the variable, or unset it") and "PolicyConfigError" not in message
    client.close()


SECRET_URL = "postgresql://app:hunter2pw@db.internal/policies"


@pytest.mark.parametrize("method", ["get", "version", "list"])
def test_a_failing_sources_error_is_typed_and_shows_no_credentials(
        config: Path, method: str) -> None:
    class Down(DictSource):
        pass

    def fail(*_: Any) -> Any:
        raise ConnectionError(f"could not connect to {SECRET_URL}")

    source = Down({"p": {"accelerator_chain": ["H100"]}}, name="pg")
    client = zml.Client(config=config)
    client.plugins.register(SourcePlugin(source), name="pg")
    setattr(source, method, fail)
    with pytest.raises(zml.PolicyConfigError) as info:
        list(client.policies) if method == "list" else client.policies.get("p")
    message = str(info.value)
    assert "'pg'" in message and "ConnectionError" in message
    assert "hunter2pw" not in message and "db.internal" in message
    client.close()


def test_a_registration_that_raises_when_the_client_is_built_fails_named_lookups_only(
        config: Path, caplog: pytest.LogCaptureFixture) -> None:
    class Down:
        @zml.hookimpl
        def zml_register_policy_sources(self, register: Callable[[Any], None]) -> None:
            raise ConnectionError(f"could not connect to {SECRET_URL}")

    zml.plugins.register(Down(), name="down-at-build")
    try:
        # as for an installed plugin: the sources are collected when the client is built
        driver = Driver("sync", config, Nodes())
    finally:
        zml.plugins.unregister(name="down-at-build")
    assert "zml_register_policy_sources failed" in caplog.text and "hunter2pw" not in caplog.text
    with pytest.raises(zml.PolicyConfigError,
                       match="plugin 'down-at-build''s zml_register_policy_sources failed"):
        driver.infer(policy="prod")
    assert driver.infer(accelerator="H100").routing.node_id == "h100-a"  # no name: it routes
    driver.plugins.unregister(name="down-at-build")
    assert driver.infer(policy="prod").routing.policy == "prod"  # names resolve once it is gone
    driver.close()


def test_a_plugin_registers_its_sources_once_per_client(driver: Driver) -> None:
    """So what it read then (an environment variable naming its store) stays the client's:
    another plugin joining or leaving the client does not ask it again."""
    calls: list[int] = []
    stores = [DictSource({"p": {"accelerator_chain": ["H100"]}}, name="first"),
              DictSource({"p": {"accelerator_chain": ["MI300X"]}}, name="second")]

    class Counting:
        @zml.hookimpl
        def zml_register_policy_sources(self, register: Callable[[Any], None]) -> None:
            calls.append(1)
            register(stores[len(calls) - 1])

    plugin = Counting()
    driver.plugins.register(plugin, name="counting")
    assert driver.infer(policy="p").routing.accelerator == "H100"
    driver.plugins.register(SourcePlugin(DictSource({})), name="other")
    driver.plugins.unregister(name="other")
    assert driver.infer(policy="p").routing.accelerator == "H100" and len(calls) == 1
    driver.plugins.unregister(name="counting")
    driver.plugins.register(plugin, name="counting")  # joining again: asked again
    assert driver.infer(policy="p").routing.accelerator == "MI300X" and len(calls) == 2


def test_unknown_name_lists_every_source(driver: Driver) -> None:
    driver.plugins.register(SourcePlugin(DictSource({"batch": {"accelerator_chain": ["A10"]}})),
                            name="dict-policies")
    with pytest.raises(zml.PolicyConfigError) as info:
        driver.infer(policy="bacth")
    assert "did you mean 'batch'" in str(info.value)
    assert "prod" in str(info.value)


def test_a_source_may_return_a_policy(driver: Driver) -> None:
    policy = zml.Policy(name="obj", accelerator_chain=["MI300X"])
    source = DictSource({})
    source.policies["obj"] = policy
    driver.plugins.register(SourcePlugin(source), name="objs")
    assert driver.client.policies["obj"] is policy


def test_register_rejects_non_sources(config: Path) -> None:
    class Wrong:
        @zml.hookimpl
        def zml_register_policy_sources(self, register: Callable[[Any], None]) -> None:
            register(object())

    client = zml.Client(config=config)
    client.plugins.register(Wrong(), name="wrong")  # sources are collected at the next lookup
    with pytest.raises(zml.PolicyConfigError, match=r"get\(name\) and list\(\).*object"):
        client.policies.get("prod")


def test_a_plugin_whose_registration_raises_is_a_policy_error_naming_the_hook(
    config: Path
) -> None:
    class Down:
        @zml.hookimpl
        def zml_register_policy_sources(self, register: Callable[[Any], None]) -> None:
            raise ConnectionError("store at redis://ops:hunter22@db:6379 is down")

    client = zml.Client(config=config)
    client.plugins.register(Down(), name="down")
    # every named lookup fails, a zml.toml name too: without the plugin's sources, a name it
    # defines could resolve to another source's policy of the same name
    with pytest.raises(zml.PolicyConfigError) as info:
        client.infer("m", [{"role": "user", "content": "hi"}], policy="prod")
    message = str(info.value)
    assert "zml_register_policy_sources failed: ConnectionError" in message
    assert "hunter22" not in message
    client.plugins.unregister(name="down")
    assert client.policies.get("prod") is not None  # and it recovers once the plugin is gone
    client.close()


def test_toml_policies_are_validated_when_the_client_is_built(tmp_path: Path) -> None:
    path = tmp_path / "zml.toml"
    path.write_text('[accelerators.H100]\n[policies.p]\naccelerator_chain = ["H10"]\n')
    with pytest.raises(zml.PolicyConfigError, match=r"\[policies\.p\].*did you mean 'H100'"):
        zml.Client(config=path)


def test_mapping_is_the_dispatchers(driver: Driver) -> None:
    policies = driver.client.policies
    assert isinstance(policies, SourcePolicies)
    assert "prod" in policies and "nope" not in policies and len(policies) == 3
    assert policies.get("nope") is None
    with pytest.raises(KeyError):
        policies["nope"]
