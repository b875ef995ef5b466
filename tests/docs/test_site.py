"""The documentation site builds with ``mkdocs build --strict``, and its API reference is whole.

Strict mode turns every warning into a failure: a broken link or anchor, a page missing from the
nav, a snippet include of a missing file, a mkdocstrings reference that does not resolve.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import zml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    return out


def test_site_builds_strict(site: Path) -> None:
    assert (site / "index.html").is_file()
    for page in ("getting-started", "concepts/routing", "configuration", "errors", "streaming",
                 "real-nodes", "performance", "migration", "changelog",
                 "integrations/langchain", "integrations/llamaindex"):
        assert (site / page / "index.html").is_file(), page


def test_api_reference_documents_every_public_name(site: Path) -> None:
    html = "\n".join(p.read_text() for p in (site / "api").rglob("index.html"))
    missing = [name for name in zml.__all__
               if name != "__version__" and f'id="zml.{name}"' not in html]
    assert not missing, f"no API reference entry for {missing}"
    # Documented from the docstrings, not just named: the classes' own summaries are there.
    assert "The synchronous zml client." in html
    assert "A named routing policy" in html


def test_api_reference_documents_the_adapters(site: Path) -> None:
    assert 'id="langchain_zml.ChatZML"' in (site / "api/langchain/index.html").read_text()
    assert 'id="llama_index.llms.zml.ZML"' in (site / "api/llamaindex/index.html").read_text()


def test_examples_are_included_not_copied(site: Path) -> None:
    """The snippet includes put the scripts of examples/ into the pages, verbatim."""
    page = (site / "integrations/langchain/index.html").read_text()
    assert "build_chain" in page and "simulated_fleet" in page  # (split by highlighting)
    assert "8&lt;--" not in page
    changelog = (site / "changelog/index.html").read_text()
    assert f"[{zml.__version__}]" in changelog


def test_no_reST_roles_left_in_the_api_reference(site: Path) -> None:
    html = "\n".join(p.read_text() for p in (site / "api").rglob("index.html"))
    assert ":class:" not in html and ":meth:" not in html
