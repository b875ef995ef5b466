"""Fleet sources: nodes and families from plugins join the registry policies validate against."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import zml
from zml.config import AcceleratorConfig, NodeConfig


class Lab:
    name = "lab-inventory"

    def __init__(self, nodes: list[Any] | None = None) -> None:
        self._nodes = nodes if nodes is not None else [
            {"id": "l40s-1", "family": "L40S", "url": "http://l40s-1:9000", "models": ["m"],
             "max_concurrency": 3},
            NodeConfig(id="h100-lab", family="H100", url="http://h100-lab:9000",
                       models=("m",), max_concurrency=1),
        ]

    def families(self) -> dict[str, Any]:
        return {"L40S": {"cost_per_hour": 1.8}, "H100": AcceleratorConfig(cost_per_hour=99.0)}

    def nodes(self) -> list[Any]:
        return self._nodes


class LabPlugin:
    def __init__(self, source: Any) -> None:
        self.source = source

    @zml.hookimpl
    def zml_register_fleet_sources(self, register: Callable[[Any], None]) -> None:
        register(self.source)


@pytest.fixture
def lab_plugin() -> Iterator[Callable[[Any], None]]:
    names: list[str] = []

    def install(source: Any) -> None:
        name = f"lab-{len(names)}"
        zml.plugins.register(LabPlugin(source), name=name)
        names.append(name)

    yield install
    for name in names:
        zml.plugins.unregister(name=name)


def test_fleet_source_adds_families_and_nodes(
    config: Path, lab_plugin: Callable[[Any], None]
) -> None:
    lab_plugin(Lab())
    client = zml.Client(config=config)
    reg = client.registry
    assert list(reg.families) == ["H100", "MI300X", "A10", "L40S"]  # zml.toml's first
    assert reg.families["H100"].cost_per_hour == 3.6  # the first declaration wins
    assert [n.id for n in reg.nodes][-2:] == ["l40s-1", "h100-lab"]
    assert client.fleet.node("l40s-1").max_concurrency == 3
    # a Policy may name the plugin's family: the client's registry is the active one
    policy = zml.Policy(name="lab", accelerator_chain=["L40S", "H100"])
    assert client.policy(policy) is policy


def test_duplicate_node_from_a_source_names_it(
    config: Path, lab_plugin: Callable[[Any], None]
) -> None:
    lab_plugin(Lab([{"id": "h100-a", "family": "H100", "url": "http://x:1", "models": ["m"],
                     "max_concurrency": 1}]))
    with pytest.raises(zml.PolicyConfigError, match=r"lab-inventory.*'h100-a' is a duplicate"):
        zml.Client(config=config)


def test_invalid_node_from_a_source_names_it(
    config: Path, lab_plugin: Callable[[Any], None]
) -> None:
    lab_plugin(Lab([{"id": "bad", "family": "L40S", "url": "ftp://x", "models": ["m"],
                     "max_concurrency": 1}]))
    with pytest.raises(zml.PolicyConfigError, match=r"lab-inventory.*nodes\[0\].*url"):
        zml.Client(config=config)


class DownInventory:
    name = "cmdb"

    def families(self) -> dict[str, Any]:
        raise ConnectionError("inventory down")

    def nodes(self) -> list[Any]:
        return []


class NotASource:
    @zml.hookimpl
    def zml_register_fleet_sources(self, register: Callable[[Any], None]) -> None:
        register(object())


def test_a_fleet_source_that_raises_is_a_policy_error_naming_it(
    config: Path, lab_plugin: Callable[[Any], None]
) -> None:
    lab_plugin(DownInventory())
    with pytest.raises(zml.PolicyConfigError,
                       match=r"fleet source 'cmdb' failed: ConnectionError: inventory down"):
        zml.Client(config=config)
    with pytest.raises(zml.PolicyConfigError, match="fleet source 'cmdb' failed"):
        zml.Policy(name="p", accelerator_chain=["H100"])  # validated against the same fleet


class RaisingRegistration:
    @zml.hookimpl
    def zml_register_fleet_sources(self, register: Callable[[Any], None]) -> None:
        raise RuntimeError("inventory client misconfigured")


def test_a_registration_that_raises_names_its_plugin(config: Path) -> None:
    zml.plugins.register(RaisingRegistration(), name="lab-inventory")
    try:
        with pytest.raises(zml.PolicyConfigError,
                           match=r"plugin 'lab-inventory''s zml_register_fleet_sources failed: "
                                 r"RuntimeError: inventory client misconfigured"):
            zml.Client(config=config)
    finally:
        zml.plugins.unregister(name="lab-inventory")


def test_registering_something_that_is_not_a_fleet_source_is_a_policy_error(
    config: Path
) -> None:
    zml.plugins.register(NotASource(), name="not-a-source")
    try:
        with pytest.raises(zml.PolicyConfigError,
                           match=r"needs families\(\) and nodes\(\).*object"):
            zml.Client(config=config)
    finally:
        zml.plugins.unregister(name="not-a-source")


def test_routes_to_a_plugin_node(
    config: Path, lab_plugin: Callable[[Any], None]
) -> None:
    import httpx2

    from .conftest import completion

    lab_plugin(Lab())
    http = httpx2.Client(transport=httpx2.MockTransport(
        lambda req: httpx2.Response(200, json=completion("m", req.url.host))))
    with zml.Client(config=config, http_client=http) as client:
        r = client.infer(model="m", messages=[{"role": "user", "content": "x"}],
                         policy={"name": "lab", "accelerator_chain": ["L40S"]})
    assert r.routing.node_id == "l40s-1"
    assert r.routing.cost is not None and r.routing.cost.basis == "node_seconds"


def test_fleet_plugin_on_a_built_client_warns(config: Path) -> None:
    client = zml.Client(config=config)
    with pytest.warns(UserWarning, match="already built its fleet"):
        client.plugins.register(LabPlugin(Lab()), name="late-lab")
    assert "L40S" not in client.registry.families
