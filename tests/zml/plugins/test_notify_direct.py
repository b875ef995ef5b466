"""Notifications called directly by the dispatcher behave as pluggy calls them: the order,
firstresult, argument mapping and isolation of a raising plugin."""

from __future__ import annotations

from typing import Any

import pytest

import zml
from zml.dispatch.effects import Effects
from zml.fleet import Fleet
from zml.plugins.manager import PluginManager


class View:
    def __init__(self) -> None:
        self.metadata = {"team": "a"}


def manager(*plugins: object) -> PluginManager:
    pm = PluginManager()
    for i, plugin in enumerate(plugins):
        pm.register(plugin, name=f"p{i}")
    return pm


def effects(pm: PluginManager) -> Effects:
    return Effects(Fleet(zml.config.EMPTY_REGISTRY), plugins=pm)


def test_firstresult_notification_matches_pluggy() -> None:
    class Late:
        @zml.hookimpl(trylast=True)
        def zml_attribute_cost(self, metadata: Any) -> zml.Cost:
            return zml.Cost(amount=2.0, basis="late")

    class Early:
        @zml.hookimpl(tryfirst=True)
        def zml_attribute_cost(self, metadata: Any) -> zml.Cost | None:
            return zml.Cost(amount=1.0, basis=metadata["team"])

    class Silent:
        @zml.hookimpl
        def zml_attribute_cost(self) -> None:
            return None

    pm = manager(Late(), Early(), Silent())
    view = View()
    spec_args = set(pm.hook.zml_attribute_cost.spec.argnames)  # type: ignore[union-attr]
    extra = {name: None for name in spec_args - {"call", "metadata"}}
    got = effects(pm).notify("zml_attribute_cost", view, extra)
    want = pm.hook.zml_attribute_cost(call=view, metadata=view.metadata, **extra)
    assert got == want == zml.Cost(amount=1.0, basis="a")


def test_plain_notification_calls_all_in_order_and_isolates(caplog: pytest.LogCaptureFixture
                                                            ) -> None:
    seen: list[str] = []

    class Boom:
        @zml.hookimpl(tryfirst=True)
        def zml_request_started(self, call: Any) -> None:
            seen.append("boom")
            raise RuntimeError("plugin bug")

    class Quiet:
        @zml.hookimpl
        def zml_request_started(self, call: Any, metadata: Any) -> None:
            seen.append(f"quiet {metadata['team']}")

    pm = manager(Quiet(), Boom())
    assert effects(pm).notify("zml_request_started", View(), {}) == []
    assert seen == ["boom", "quiet a"]
    assert "plugin bug" in caplog.text or "raised in zml_request_started" in caplog.text
    pm.unregister(name="p0")
    seen.clear()
    effects(pm).notify("zml_request_started", View(), {})
    assert seen == ["boom"]  # the cache follows registrations
