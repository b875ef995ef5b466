"""The public surface: ``zml.__all__``, the lazy export map and the typed re-exports agree."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import zml


def test_all_matches_the_lazy_export_map() -> None:
    assert sorted(zml.__all__) == sorted([*zml._EXPORTS, "__version__"])
    assert zml.__version__ == "0.3.0"


def test_every_public_name_resolves() -> None:
    for name in zml.__all__:
        assert getattr(zml, name) is not None, name
    assert "Client" in dir(zml)


def test_type_checkers_see_every_public_name() -> None:
    tree = ast.parse(Path(zml.__file__).read_text())
    guarded = next(n for n in tree.body if isinstance(n, ast.If))
    reexported = {
        alias.asname
        for node in guarded.body
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.asname == alias.name  # "X as X": an explicit re-export for mypy --strict
    }
    assert reexported == set(zml._EXPORTS)


def test_import_zml_is_light() -> None:
    code = (
        "import sys, zml; heavy = [m for m in ('pydantic', 'httpx2', 'pluggy', 'opentelemetry',"
        " 'zml.client', 'zml.plugins') if m in sys.modules]; print(heavy)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "[]"


def test_unknown_attribute_is_an_attribute_error() -> None:
    try:
        zml.Clinet  # noqa: B018
    except AttributeError as exc:
        assert "Clinet" in str(exc)
    else:  # pragma: no cover
        raise AssertionError("expected AttributeError")
