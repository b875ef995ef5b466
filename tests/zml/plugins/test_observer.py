"""Telemetry hooks: called for every request of both clients, in order, never failing one."""

from __future__ import annotations

import logging
from typing import Any

import pytest

import zml

from .conftest import Driver, Nodes, Recorder


def test_hooks_in_order_with_metadata_for_a_fallback(
    driver: Driver, recorder: Recorder, nodes: Nodes
) -> None:
    nodes.status["h100-a"] = 503
    driver.plugins.register(recorder, name="recorder")
    r = driver.infer(policy="prod", metadata={"team": "search", "service": "qa"})
    assert recorder.names() == ["started", "routed", "attempt_failed", "routed", "completed"]
    for _, args in recorder.events:
        assert args["metadata"] == {"team": "search", "service": "qa"}
    started = recorder.events[0][1]["call"]
    assert started.model == "m" and started.policy_name == "prod" and not started.stream
    failed = recorder.events[2][1]
    assert failed["attempt"].node_id == "h100-a" and failed["attempt"].status_code == 503
    assert isinstance(failed["error"], zml.NodeUnavailableError)
    done = recorder.events[-1][1]
    assert done["routing"] is r.routing and done["cost"] == r.routing.cost
    assert done["usage"]["total_tokens"] == 8 and done["held_s"] >= 0
    assert r.routing.metadata == {"team": "search", "service": "qa"}


def test_failed_and_cancelled(driver: Driver, recorder: Recorder) -> None:
    driver.plugins.register(recorder, name="recorder")
    with pytest.raises(zml.RoutingError):
        driver.infer(model="not-served", policy="prod")
    assert recorder.names() == ["started", "failed"]
    assert isinstance(recorder.events[-1][1]["error"], zml.RoutingError)
    recorder.events.clear()
    driver.stream(stop_after=1, policy="prod")
    assert recorder.names() == ["started", "routed", "cancelled"]
    recorder.events.clear()
    driver.stream(policy="prod", metadata={"team": "t"})
    assert recorder.names() == ["started", "routed", "completed"]
    assert recorder.events[-1][1]["usage"]["total_tokens"] == 5


def test_an_attempt_that_ends_the_request_is_a_failed_attempt_too(
    driver: Driver, recorder: Recorder, nodes: Nodes
) -> None:
    nodes.status["h100-a"] = 401  # not retried: the request fails with this attempt
    driver.plugins.register(recorder, name="recorder")
    with pytest.raises(zml.AuthenticationError):
        driver.infer(policy="prod")
    assert recorder.names() == ["started", "routed", "attempt_failed", "failed"]
    failed = recorder.events[2][1]
    assert failed["attempt"].node_id == "h100-a" and failed["attempt"].status_code == 401
    assert [a.node_id for a in recorder.events[0][1]["call"].attempts] == ["h100-a"]


class Broken:
    """Raises in every telemetry hook, and in the cost hook."""

    calls = 0

    @zml.hookimpl(tryfirst=True)
    def zml_request_started(self) -> None:
        Broken.calls += 1
        raise RuntimeError("boom in started")

    @zml.hookimpl(tryfirst=True)
    def zml_request_routed(self) -> None:
        raise RuntimeError("boom in routed")

    @zml.hookimpl(tryfirst=True)
    def zml_request_completed(self) -> None:
        raise RuntimeError("boom in completed")

    @zml.hookimpl(tryfirst=True)
    def zml_request_failed(self) -> None:
        raise RuntimeError("boom in failed")

    @zml.hookimpl(tryfirst=True)
    def zml_attribute_cost(self) -> Any:
        raise RuntimeError("boom in cost")


def test_a_raising_plugin_never_fails_the_request(
    driver: Driver, recorder: Recorder, caplog: pytest.LogCaptureFixture
) -> None:
    name = f"broken-{driver.kind}"
    driver.plugins.register(Broken(), name=name)
    driver.plugins.register(recorder, name="recorder")
    with caplog.at_level(logging.DEBUG, logger="zml.plugins"):
        first = driver.infer(policy="prod")
        second = driver.infer(policy="prod")
        with pytest.raises(zml.RoutingError):
            driver.infer(model="not-served", policy="prod")
    assert first.choices[0].message.content == "from h100-a"
    assert second.routing.cost is not None  # the default model took over from the broken one
    assert second.routing.cost.basis == "node_seconds"
    # the other plugins still saw every event
    assert recorder.names().count("completed") == 2
    assert recorder.names()[-1] == "failed"
    mine = [r for r in caplog.records if name in r.getMessage()]
    warnings = [r for r in mine if r.levelno == logging.WARNING]
    # once per hook at WARNING (started, routed, cost, completed, failed); repeats at DEBUG
    assert sorted(r.getMessage().split(" raised in ")[1].split(" ")[0] for r in warnings) == [
        "zml_attribute_cost", "zml_request_completed", "zml_request_failed",
        "zml_request_routed", "zml_request_started",
    ]
    assert warnings[0].exc_info is not None
    assert any(r.levelno == logging.DEBUG for r in mine)


def test_unregistered_plugin_is_no_longer_called(driver: Driver, recorder: Recorder) -> None:
    driver.plugins.register(recorder, name="recorder")
    driver.infer(policy="prod")
    driver.plugins.unregister(name="recorder")
    driver.infer(policy="prod")
    assert recorder.names().count("completed") == 1


def test_client_plugins_are_per_client(make_driver: Any, recorder: Recorder) -> None:
    one, two = make_driver(), make_driver()
    one.plugins.register(recorder, name="recorder")
    two.infer(policy="prod")
    assert recorder.events == []
    one.infer(policy="prod")
    assert recorder.names()[-1] == "completed"


class Idle(Recorder):
    """A recorder that is idle while ``idle`` is set (the ``zml_idle`` protocol)."""

    def __init__(self) -> None:
        super().__init__()
        self.idle: bool | Exception = True

    def zml_idle(self) -> bool:
        if isinstance(self.idle, Exception):
            raise self.idle
        return self.idle


def test_hooks_only_an_idle_plugin_implements_are_not_called(driver: Driver) -> None:
    for hook in ("zml_request_started", "zml_request_routed", "zml_request_completed"):
        for impl in driver.plugins.impls(hook):  # the built-in and installed ones (zml-redis)
            driver.plugins.unregister(impl.plugin)
    idle = Idle()
    driver.plugins.register(idle, name="idle")
    driver.infer(policy="prod")
    assert idle.events == []
    assert not driver.plugins.wanted("zml_request_started")
    idle.idle = False
    driver.infer(policy="prod")
    assert idle.names() == ["started", "routed", "completed"]


def test_an_idle_plugin_still_hears_what_another_plugin_wants(
    driver: Driver, recorder: Recorder
) -> None:
    idle = Idle()
    driver.plugins.register(idle, name="idle")
    driver.plugins.register(recorder, name="recorder")
    driver.infer(policy="prod")
    assert recorder.names() == idle.names() == ["started", "routed", "completed"]


def test_a_failing_idle_check_counts_as_not_idle_and_is_logged(
    driver: Driver, caplog: pytest.LogCaptureFixture
) -> None:
    idle = Idle()
    idle.idle = RuntimeError("boom in zml_idle")
    driver.plugins.register(idle, name="idle")
    with caplog.at_level(logging.WARNING, logger="zml.plugins"):
        driver.infer(policy="prod")
    assert idle.names() == ["started", "routed", "completed"]
    assert "boom in zml_idle" in caplog.text and "idle" in caplog.text
