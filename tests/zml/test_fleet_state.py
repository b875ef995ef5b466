"""The fleet's live node state: what a call teaches it, and the circuit as shown at a time."""

from __future__ import annotations

import pytest

from zml.config import AcceleratorConfig, NodeConfig, Registry
from zml.fleet import CIRCUIT_COOLDOWN_S, CIRCUIT_FAILURES, Fleet


def fleet() -> Fleet:
    return Fleet(Registry(
        {"H100": AcceleratorConfig()},
        (NodeConfig(id="a", family="H100", url="http://127.0.0.1:9", models=("m",),
                    max_concurrency=2),),
    ))


def test_a_success_without_a_ttft_updates_the_service_time_only() -> None:
    f = fleet()
    node = f.node("a")
    f.record_success(node, 1.0, None, 1.3)
    assert node.service_ms == pytest.approx(1300.0)
    assert node.ttft_ms is None and node.observed_ttft_ms is None and node.latency_ms is None
    f.record_success(node, 2.0, 0.05, 0.5)
    assert node.observed_ttft_ms == pytest.approx(50.0) and node.latency_ms == node.observed_ttft_ms
    f.record_success(node, 3.0, None, 1.3)
    assert node.observed_ttft_ms == pytest.approx(50.0)  # a whole answer leaves it alone


def test_the_circuit_is_shown_half_open_once_its_cooldown_is_over() -> None:
    f = fleet()
    node = f.node("a")
    t = 100.0
    assert node.circuit_at(t) == "closed"
    for _ in range(CIRCUIT_FAILURES):
        f.record_failure(node, t)
    during, after = t + CIRCUIT_COOLDOWN_S / 2, t + CIRCUIT_COOLDOWN_S
    assert node.circuit_at(during) == "open" and not node.circuit_allows(during)
    assert node.circuit_at(after) == "half_open" and node.circuit_allows(after)
    assert [s["circuit"] for s in f.status(during)] == ["open"]
    assert [s["circuit"] for s in f.status(after)] == ["half_open"]  # zml fleet status
    trial = f.reserve(node, after)
    assert node.circuit_at(after) == "half_open" and not node.circuit_allows(after)
    f.release(trial)
    f.record_success(node, after, 0.01, 0.1)
    assert node.circuit_at(after) == "closed" and node.circuit_state == "closed"
