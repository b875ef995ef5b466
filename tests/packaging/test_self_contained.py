"""The repository stands on its own: no doc, test, example or package refers to a file outside
it (the steering folder that sits beside a working checkout is not there in a user's clone, nor
in a published sdist)."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("README.md", "CHANGELOG.md", "docs", "tests", "examples", "zml_core", "integrations",
           "plugins", "benchmarks", "mkdocs.yml", "pyproject.toml", ".ci")
TEXT_SUFFIXES = {".py", ".md", ".toml", ".txt", ".yml", ".yaml", ".json", ".cfg", ".ini", ""}
# Written in pieces so that this file does not match itself.
OUTSIDE = re.compile(r"\.\./" + "shared" + r"|/work/" + "shared" + r"|\bshared/(DESIGN|STYLE|seed|traces)\b")
# A distribution's README becomes its PyPI page, where a relative link leads nowhere.
RELATIVE_LINK = re.compile(r"\]\((?!https?://|mailto:|#)([^)\s]+)\)")
DISTRIBUTION_READMES = ("zml_core", "integrations/langchain", "integrations/llama-index",
                        "plugins/redis", "plugins/sqlite")


def text_files() -> Iterator[Path]:
    for name in SCANNED:
        top = ROOT / name
        if top.is_file():
            yield top
            continue
        for path in top.rglob("*"):
            parts = path.relative_to(ROOT).parts
            if any((p.startswith(".") and p != ".ci") or p in ("__pycache__", "site")
                   for p in parts):
                continue
            if path.is_file() and path.suffix in TEXT_SUFFIXES:
                yield path


def test_nothing_refers_outside_the_repository() -> None:
    hits = []
    for path in text_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        for number, line in enumerate(text.splitlines(), 1):
            if OUTSIDE.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()[:100]}")
    assert not hits, "copy what is needed into the repository:\n" + "\n".join(hits)


def test_scan_covers_the_tree() -> None:
    scanned = {p.relative_to(ROOT).as_posix() for p in text_files()}
    assert "tests/e2e/test_seed_examples.py" in scanned
    assert "zml_core/src/zml/__init__.py" in scanned
    assert "docs/architecture.md" in scanned
    assert ".ci/run" in scanned


def test_distribution_readmes_have_no_relative_links() -> None:
    for folder in DISTRIBUTION_READMES:
        readme = (ROOT / folder / "README.md").read_text(encoding="utf-8")
        assert not RELATIVE_LINK.findall(readme), (folder, RELATIVE_LINK.findall(readme))
