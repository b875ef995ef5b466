"""The hook specifications are the plugin author's documentation: check they are complete."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

import zml
from zml.plugins import hookspecs
from zml.plugins.manager import NOTIFICATION_HOOKS, PluginManager

DOC = Path(__file__).resolve().parents[3] / "docs" / "plugins.md"


def hookspec_names() -> list[str]:
    pm = PluginManager()
    names = [name for name in dir(hookspecs) if pm.parse_hookspec_opts(hookspecs, name)]
    assert len(names) >= 9
    return names


@pytest.mark.parametrize("name", hookspec_names())
def test_every_hookspec_is_documented_in_the_guide(name: str) -> None:
    text = DOC.read_text()
    assert re.search(rf"^### `{name}\(", text, re.M), f"docs/plugins.md has no section for {name}"


@pytest.mark.parametrize("name", hookspec_names())
def test_every_hookspec_documents_each_parameter_and_its_result(name: str) -> None:
    spec = getattr(hookspecs, name)
    doc = inspect.getdoc(spec) or ""
    for param in inspect.signature(spec).parameters:
        assert re.search(rf"^\s+{param}: ", doc, re.M), f"{name}: parameter {param} undocumented"
    assert "Returns:" in doc
    assert "Called " in doc, f"{name}: say when it is called"


def test_firstresult_is_marked_and_documented() -> None:
    pm = PluginManager()
    for name in hookspec_names():
        opts = pm.parse_hookspec_opts(hookspecs, name)
        assert opts is not None
        doc = inspect.getdoc(getattr(hookspecs, name)) or ""
        if opts["firstresult"]:
            assert "first non-None" in doc, name
        else:
            assert "not ``firstresult``" in doc or "notification" in doc, name
    assert pm.parse_hookspec_opts(hookspecs, "zml_attribute_cost")["firstresult"]  # type: ignore[index]


def test_notification_hooks_are_specs() -> None:
    assert set(NOTIFICATION_HOOKS) <= set(hookspec_names())


def test_hookimpl_is_exported() -> None:
    assert zml.hookimpl is hookspecs.hookimpl
    assert "hookimpl" in zml.__all__
    assert hookspecs.hookimpl.project_name == "zml"
    assert hookspecs.hookspec.project_name == "zml"
