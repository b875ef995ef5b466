"""Cost attribution: the default model, and a plugin that overrides it."""

from __future__ import annotations

from typing import Any

import pytest

import zml
from zml.config import AcceleratorConfig, NodeConfig
from zml.plugins.default.cost import default_cost

from .conftest import Driver, Nodes, Recorder


def test_default_model_node_seconds(driver: Driver, recorder: Recorder) -> None:
    driver.plugins.register(recorder, name="recorder")
    r = driver.infer(policy="h100only")
    held_s = recorder.events[-1][1]["held_s"]
    assert r.routing.cost is not None
    assert r.routing.cost.basis == "node_seconds" and r.routing.cost.currency == "USD"
    # H100: cost_per_hour 3.6, node max_concurrency 2
    assert r.routing.cost.amount == pytest.approx(3.6 / 3600 * held_s / 2)


def test_default_model_tokens(driver: Driver, nodes: Nodes) -> None:
    nodes.status["h100-a"] = 503  # fail over to MI300X, priced per 1k tokens
    r = driver.infer(policy="prod")
    assert r.routing.accelerator == "MI300X"
    assert r.routing.cost == zml.Cost(amount=0.5 * 8 / 1000, basis="tokens")


def test_no_price_no_cost(driver: Driver) -> None:
    assert driver.infer(policy="cheap").routing.cost is None


def test_stream_cost_is_set_when_the_stream_ends(driver: Driver) -> None:
    stream, _ = driver.stream(policy="h100only")
    assert stream.routing.cost is not None and stream.routing.cost.basis == "node_seconds"


def test_default_cost_formula() -> None:
    node = NodeConfig(id="n", family="F", url="http://n:1", models=("m",), max_concurrency=8)
    hourly = AcceleratorConfig(cost_per_hour=7.2)
    cost = default_cost(hourly, node, None, 10.0)
    assert cost is not None and cost.amount == pytest.approx(7.2 / 3600 * 10.0 / 8)
    both = AcceleratorConfig(cost_per_hour=7.2, cost_per_1k_tokens=2.0)
    assert default_cost(both, node, {"total_tokens": 500}, 10.0) == zml.Cost(
        amount=1.0, basis="tokens")
    # no usage reported: fall back to node-seconds
    fallback = default_cost(both, node, None, 10.0)
    assert fallback is not None and fallback.basis == "node_seconds"
    assert default_cost(AcceleratorConfig(), node, {"total_tokens": 5}, 1.0) is None
    assert default_cost(None, node, None, 1.0) is None


class FlatRate:
    """Charges research a flat rate; leaves everyone else to the next implementation."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []

    @zml.hookimpl
    def zml_attribute_cost(self, routing: Any, usage: Any, held_s: float,
                           accelerator: Any, node: Any, metadata: Any) -> Any:
        self.seen.append({"accelerator": accelerator, "node": node, "metadata": metadata})
        if metadata.get("team") == "research":
            return zml.Cost(amount=0.25, currency="EUR", basis="flat")
        if metadata.get("team") == "dict":
            return {"amount": 1.5, "basis": "mapping"}
        return None


def test_a_cost_plugin_overrides_the_default(driver: Driver) -> None:
    plugin = FlatRate()
    driver.plugins.register(plugin, name="flat-rate")
    research = driver.infer(policy="h100only", metadata={"team": "research"})
    assert research.routing.cost == zml.Cost(amount=0.25, currency="EUR", basis="flat")
    mapping = driver.infer(policy="h100only", metadata={"team": "dict"})
    assert mapping.routing.cost == zml.Cost(amount=1.5, basis="mapping")
    other = driver.infer(policy="h100only", metadata={"team": "search"})
    assert other.routing.cost is not None and other.routing.cost.basis == "node_seconds"
    seen = plugin.seen[0]
    assert seen["accelerator"].cost_per_hour == 3.6
    assert seen["node"].id == "h100-a" and seen["node"].max_concurrency == 2


def test_process_wide_cost_plugin(config: Any) -> None:
    plugin = FlatRate()
    zml.plugins.register(plugin, name="flat-rate-global")
    try:
        client = zml.Client(config=config)
        assert client.plugins.has_plugin("flat-rate-global")
    finally:
        zml.plugins.unregister(name="flat-rate-global")
    assert not zml.Client(config=config).plugins.has_plugin("flat-rate-global")
