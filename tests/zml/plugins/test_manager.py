"""Loading plugins: entry points, the switches, failures, validation, order."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pluggy
import pytest

import zml
from zml.plugins.manager import PluginManager, discover, register_defaults

_counter = itertools.count()


@pytest.fixture
def fake_dist(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Callable[[dict[str, str]], dict[str, str]]]:
    """Install a fake distribution ``fakeplug-N``: entry point name -> module source (None:
    a module that does not exist). Returns entry point name -> module name."""
    created: list[str] = []

    def make(plugins: dict[str, str | None], dist: str | None = None) -> dict[str, str]:
        n = next(_counter)
        dist = dist or f"fakeplug{n}"
        site = tmp_path / f"site{n}"
        info = site / f"{dist.replace('-', '_')}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
        lines = ["[zml]"]
        modules = {}
        for ep, source in plugins.items():
            module = f"fake_{ep}_{n}"
            modules[ep] = module
            lines.append(f"{ep} = {module}")
            if source is not None:
                (site / f"{module}.py").write_text(textwrap.dedent(source))
                created.append(module)
        (info / "entry_points.txt").write_text("\n".join(lines) + "\n")
        monkeypatch.syspath_prepend(str(site))
        modules["dist"] = dist
        return modules

    yield make
    for module in created:
        sys.modules.pop(module, None)


GOOD = """
import zml

@zml.hookimpl
def zml_attribute_cost(metadata):
    return zml.Cost(amount=1.0, basis=__name__)
"""
TYPO = """
import zml

@zml.hookimpl
def zml_request_complete(cost):
    pass
"""


def names(pm: PluginManager) -> set[str]:
    return {name for name, plugin in pm.list_name_plugin() if plugin is not None}


def test_autoload_loads_good_and_warns_once_for_each_bad(fake_dist: Any) -> None:
    mods = fake_dist({"good": GOOD, "broken": None, "typo": TYPO})
    pm = PluginManager()
    with pytest.warns(RuntimeWarning) as record:
        loaded = discover(pm, {})
    messages = [str(w.message) for w in record]
    assert ("good", mods["dist"]) in loaded
    assert "good" in names(pm) and "broken" not in names(pm) and "typo" not in names(pm)
    broken = [m for m in messages if "'broken'" in m]
    assert len(broken) == 1 and "failed to import" in broken[0] and mods["dist"] in broken[0]
    assert "ModuleNotFoundError" in broken[0]
    typo = [m for m in messages if "'typo'" in m]
    assert len(typo) == 1 and "unknown hook 'zml_request_complete'" in typo[0]


def test_disable_autoload(fake_dist: Any) -> None:
    fake_dist({"good": GOOD})
    pm = PluginManager()
    assert discover(pm, {"ZML_DISABLE_PLUGIN_AUTOLOAD": "1"}) == []
    assert names(pm) == set()


def test_zml_plugins_selects_by_entry_point_or_distribution(fake_dist: Any) -> None:
    mods = fake_dist({"good": GOOD, "other": GOOD})
    pm = PluginManager()
    discover(pm, {"ZML_DISABLE_PLUGIN_AUTOLOAD": "1", "ZML_PLUGINS": "good"})
    assert names(pm) == {"good"}
    pm = PluginManager()
    discover(pm, {"ZML_PLUGINS": f" {mods['dist']} "})
    assert names(pm) == {"good", "other"}
    pm = PluginManager()
    assert discover(pm, {"ZML_PLUGINS": ""}) == []
    with pytest.warns(RuntimeWarning, match="not installed: nothere"):
        discover(PluginManager(), {"ZML_PLUGINS": "good,nothere"})


def test_zml_plugins_names_a_distribution_in_any_spelling_of_its_name(fake_dist: Any) -> None:
    """As pip does (PEP 503): "zml_policy_sqlite" named nothing installed, and loaded
    nothing, while zml-policy-sqlite was installed."""
    dist = fake_dist({"hyphenated": GOOD}, dist=f"fake-plug-{next(_counter)}")["dist"]
    for spelling in (dist.replace("-", "_"), dist.upper(), dist.replace("-", ".")):
        pm = PluginManager()
        discover(pm, {"ZML_PLUGINS": spelling})
        assert names(pm) == {"hyphenated"}, spelling


def test_installed_plugins_are_called_in_entry_point_name_order(fake_dist: Any) -> None:
    mods = fake_dist({"b_second": GOOD, "a_first": GOOD})
    pm = PluginManager()
    register_defaults(pm)
    discover(pm, {"ZML_PLUGINS": mods["dist"]})
    called = [impl.plugin_name for impl in pm.impls("zml_attribute_cost")]
    assert called == ["a_first", "b_second", "zml.cost"]


def test_the_zml_entry_points_are_those_importlib_selects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Only files with a [zml] section are parsed; what is found is what
    # importlib.metadata.entry_points(group="zml") selects, in the same order: here, among
    # other groups, an extra named "zml" in another group, a look-alike section, and one
    # distribution installed twice.
    from importlib import metadata

    from zml.plugins.manager import _group_entry_points

    files = {
        "mixed": "[console_scripts]\nmixed = mixed:main\n\n[zml]\nmixed = mixed_plugin\n"
                 "\n[other]\nx = y:z\n",
        "extra": "[console_scripts]\nextra = extra:main [zml]\n",
        "spaced": "[ zml ]\nspaced = spaced_plugin\n",
        "none": "[console_scripts]\nnone = none:main\n",
    }
    for site, dists in ((tmp_path / "site", files),
                        # the same distribution again, later on the path: it counts once
                        (tmp_path / "later", {"mixed": "[zml]\nshadowed = shadowed_plugin\n"})):
        for name, text in dists.items():
            info = site / f"ep{name}-1.0.dist-info"
            info.mkdir(parents=True)
            (info / "METADATA").write_text(
                f"Metadata-Version: 2.1\nName: ep{name}\nVersion: 1.0\n")
            (info / "entry_points.txt").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path / "later"))
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    entry_points = _group_entry_points()
    found = [(ep.name, ep.value, ep.group) for ep, _ in entry_points]
    assert found == [(ep.name, ep.value, ep.group)
                     for ep in metadata.entry_points(group="zml")]
    assert entry_points[0][1] == "epmixed"  # with its distribution's name
    assert found[0] == ("mixed", "mixed_plugin", "zml")
    assert "shadowed" not in {name for name, _, _ in found}
    assert {"policy_sqlite", "redis"} <= {name for name, _, _ in found}  # the installed ones


def test_misspelled_hook_in_code_is_refused() -> None:
    class Typo:
        @zml.hookimpl
        def zml_request_complete(self) -> None: ...

    pm = PluginManager()
    with pytest.raises(pluggy.PluginValidationError, match="zml_request_complete"):
        pm.register(Typo(), name="typo")
    assert not pm.has_plugin("typo")


def test_bad_argument_name_is_refused() -> None:
    class Wrong:
        @zml.hookimpl
        def zml_request_completed(self, response: Any) -> None: ...

    with pytest.raises(pluggy.PluginValidationError, match="response"):
        PluginManager().register(Wrong(), name="wrong")


def test_optional_hooks_are_allowed() -> None:
    class Future:
        @zml.hookimpl(optionalhook=True)
        def zml_node_probed(self) -> None: ...

    assert PluginManager().register(Future(), name="future") == "future"


def test_wrappers_on_notification_hooks_are_refused() -> None:
    class Wrapper:
        @zml.hookimpl(wrapper=True)
        def zml_attribute_cost(self) -> Any:
            return (yield)

    pm = PluginManager()
    with pytest.raises(pluggy.PluginValidationError, match="wrapper"):
        pm.register(Wrapper(), name="wrapper")
    assert not pm.has_plugin("wrapper")


def _found(pm: pluggy.PluginManager, plugin: Any) -> list[str]:
    """The hooks ``plugin`` implements in ``pm``, one entry per implementation."""
    return sorted(c.name for c in pm.get_hookcallers(plugin) or ()
                  for impl in c.get_hookimpls() if impl.plugin is plugin)


def test_registration_finds_what_pluggy_finds() -> None:
    # zml's manager skips names that cannot hold a hook before pluggy's static lookup; what it
    # registers is what pluggy's own parsing registers, for every kind of plugin object.
    import types

    from zml.plugins import hookspecs

    class Kinds:
        @zml.hookimpl
        def zml_request_started(self, call: Any) -> None: ...

        @zml.hookimpl(specname="zml_request_completed")
        def completed(self, call: Any) -> None: ...

        @staticmethod
        @zml.hookimpl
        def zml_request_failed(call: Any) -> None: ...

        @classmethod
        @zml.hookimpl
        def zml_attempt_failed(cls, call: Any) -> None: ...

        not_a_hook = 3

    module = types.ModuleType("plugin_module")
    vars(module).update(
        zml_request_started=Kinds().zml_request_started,  # a bound method in a module
        completed=Kinds.completed,
        zml_request_failed=Kinds.__dict__["zml_request_failed"],  # a staticmethod object
        constant={"zml_impl": {}},
    )
    with zml.Client(config=None) as client:
        installed = [p for _, p in client.plugins.list_name_plugin()]
    plugins = [Kinds(), Kinds, module, *installed]
    for plugin in plugins:
        ours, reference = PluginManager(), pluggy.PluginManager("zml")
        reference.add_hookspecs(hookspecs)
        ours.register(plugin, "p")
        reference.register(plugin, "p")
        assert _found(ours, plugin) == _found(reference, plugin), plugin
    in_module, in_class = PluginManager(), PluginManager()
    in_module.register(module, "module")
    in_class.register(Kinds(), "kinds")
    assert _found(in_module, module) == [
        "zml_request_completed", "zml_request_failed", "zml_request_started"]
    assert _found(in_class, in_class.get_plugin("kinds")) == [
        "zml_attempt_failed", "zml_request_completed", "zml_request_failed",
        "zml_request_started"]


COST_ARGS = {"call": None, "routing": None, "usage": {"total_tokens": 10}, "held_s": 1.0,
             "accelerator": None, "node": None, "metadata": {}}
DONE_ARGS = {"call": None, "routing": None, "usage": None, "held_s": 1.0, "cost": None,
             "metadata": {}}


def test_call_answers_as_pluggy_does() -> None:
    # One implementation is called directly; the answer is what pluggy's own call gives, for
    # a firstresult hook and a plain one, for None and for a value, and with more plugins.
    seen: list[float] = []

    class Price:
        def __init__(self, amount: float | None) -> None:
            self.amount = amount

        @zml.hookimpl
        def zml_attribute_cost(self, held_s: float) -> Any:
            seen.append(held_s)
            return None if self.amount is None else zml.Cost(amount=self.amount, basis="x")

        @zml.hookimpl
        def zml_request_completed(self, held_s: float) -> Any:
            return self.amount  # a notification's return value is what pluggy collects

    for plugins in ([Price(1.5)], [Price(None)], [Price(None), Price(2.0)]):
        pm = PluginManager()
        for i, plugin in enumerate(plugins):
            pm.register(plugin, f"p{i}")
        for hook, kwargs in (("zml_attribute_cost", COST_ARGS),
                             ("zml_request_completed", DONE_ARGS)):
            assert pm.call(hook, kwargs) == getattr(pm.hook, hook)(**kwargs), (hook, plugins)
    assert seen and set(seen) == {1.0}
    assert PluginManager().call("zml_attribute_cost", COST_ARGS) is None  # no implementation
    assert PluginManager().call("zml_request_completed", DONE_ARGS) == []


def test_call_goes_through_pluggy_for_wrappers_and_monitoring() -> None:
    class Price:
        @zml.hookimpl
        def zml_attribute_cost(self) -> Any:
            return zml.Cost(amount=1.0, basis="x")

    class Wrapper:
        @zml.hookimpl(wrapper=True)
        def zml_register_policy_sources(self) -> Any:
            return (yield)

    pm = PluginManager()
    pm.register(Price(), "price")
    traced: list[str] = []
    undo = pm.add_hookcall_monitoring(lambda name, impls, kw: traced.append(name),
                                      lambda outcome, name, impls, kw: None)
    assert pm.call("zml_attribute_cost", COST_ARGS).amount == 1.0
    assert traced == ["zml_attribute_cost"]  # monitoring sees the call
    undo()
    pm = PluginManager()
    pm.register(Wrapper(), "wrapper")
    # called directly, the wrapper would answer its generator; through pluggy, nothing
    args = {"register": lambda source: None, "registry": None}
    assert pm.call("zml_register_policy_sources", args) == []


def test_defaults_are_plugins() -> None:
    client = zml.Client(config=None)
    assert {"zml.static_fleet", "zml.toml_policies", "zml.cost", "zml.otel"} <= names(
        client.plugins)
    client.plugins.set_blocked("zml.otel")
    assert not client.plugins.has_plugin("zml.otel") and client.plugins.is_blocked("zml.otel")
    assert client.plugins.copy().is_blocked("zml.otel")


def _python(code: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    import os

    environ = {k: v for k, v in os.environ.items() if not k.startswith("ZML_")}
    environ.update(env or {})
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=environ,
                         capture_output=True, text=True, timeout=60, check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


CHECK_MODULES = """
import json, sys
{setup}
bad = sorted(m for m in sys.modules if m.startswith(("zml.plugins.manager",
             "zml.plugins.default", "zml_policy_sqlite", "opentelemetry.sdk")))
print(json.dumps({{"bad": bad, "otel": sorted(m for m in sys.modules
                                            if m.startswith("opentelemetry"))[:3],
                   "plugins": {plugins}}}))
"""


def test_import_zml_loads_no_plugin() -> None:
    code = CHECK_MODULES.format(setup="import zml\nzml.hookimpl\nimport zml.plugins",
                                plugins="[]")
    result = _python(code, {"ZML_POLICY_SQLITE_DB": "/nonexistent/x.db"})
    assert result["bad"] == [] and result["otel"] == []


def test_disable_autoload_keeps_the_installed_sqlite_plugin_out(tmp_path: Path) -> None:
    setup = "import zml\nclient = zml.Client()"
    plugins = "[n for n, _ in client.plugins.list_name_plugin()]"
    env = {"ZML_POLICY_SQLITE_DB": str(tmp_path / "p.db")}
    loaded = _python(CHECK_MODULES.format(setup=setup, plugins=plugins), env)
    assert "policy_sqlite" in loaded["plugins"]
    assert "zml_policy_sqlite" in loaded["bad"]
    disabled = _python(CHECK_MODULES.format(setup=setup, plugins=plugins),
                       {**env, "ZML_DISABLE_PLUGIN_AUTOLOAD": "1"})
    assert "policy_sqlite" not in disabled["plugins"]
    assert "zml.otel" in disabled["plugins"]
    assert not any(m.startswith("zml_policy_sqlite") for m in disabled["bad"])
    assert not any(m.startswith("opentelemetry.sdk") for m in disabled["bad"])
