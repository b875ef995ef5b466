"""The site's MkDocs hooks (docs/_hooks/) change only what they are meant to."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType, SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "docs" / "_hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repo_links_unlinks_only_existing_files_outside_docs() -> None:
    hook = load("repo_links")
    page = SimpleNamespace(file=SimpleNamespace(src_path="plugins.md"))
    config = {"docs_dir": str(ROOT / "docs")}
    text = (
        "See [`hookspecs.py`](../zml_core/src/zml/plugins/hookspecs.py) and "
        "[examples](../examples/) and [gone](../no/such/file.py) and "
        "[errors](errors.md) and [web](https://example.org/x).\n"
        "```python\n[x](../examples/)\n```\n"
    )
    out = hook.on_page_markdown(text, page=page, config=config)
    assert "See `hookspecs.py` and examples and [gone](../no/such/file.py)" in out
    assert "[errors](errors.md)" in out and "[web](https://example.org/x)" in out
    assert "```python\n[x](../examples/)\n```" in out


def test_rst_roles_dropped_before_code_only() -> None:
    hook = load("rst_roles")
    html = "a :class:<code>~zml.types.Usage</code> b :meth:<code>Client.infer</code> c :class: d"
    assert hook.on_page_content(html) == (
        "a <code>zml.types.Usage</code> b <code>Client.infer</code> c :class: d"
    )
