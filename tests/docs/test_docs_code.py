"""The code shown in docs/ runs, and prints what the page says it prints.

The rules for a page of docs/ (checked here):

* a ```` ```python ```` block is executed; a block made only of snippet lines
  (``--8<-- "examples/NAME.py"``) is included from ``examples/`` at build time instead, and
  those scripts are run by ``tests/examples`` and ``tests/integrations``;
* a ```` ```pycon ```` block is a doctest: each ``>>>`` line runs and its output must match
  (``...`` matches anything, whitespace is normalised);
* the blocks of one page run in order, in one namespace, from a fresh temporary folder;
* a page containing ``<!-- docs-test: seed-fleet -->`` runs in a folder whose ``./zml.toml``
  describes a running simulated fleet: the fleet of the 0.3 release post (``seed_fleet``);
* ```` ```toml ```` blocks must parse, and their keys must be keys zml accepts;
* pages owned by another part of the project (``OWNED_ELSEWHERE``) are left to its tests;
* no other language tag may hold Python (``py``, ``python3``... are refused, so that no
  Python block escapes this test).
"""

from __future__ import annotations

import doctest
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
SEED_MARKER = "<!-- docs-test: seed-fleet -->"
# Pages another part of the project owns and tests: docs/plugins.md belongs to the plugin
# system, whose runnable example is examples/custom_plugin/ (tests/zml/plugins run it and
# check the page's hook sections).
OWNED_ELSEWHERE = {"plugins.md"}
RUN_LANGS = {"python", "pycon"}
OTHER_LANGS = {"toml", "bash", "console", "text", "json", "ini", "yaml", "http", "mermaid",
               "javascript", ""}
SNIPPET = re.compile(r'^\s*--8<--\s+"(?P<path>[^"]+)"\s*$')
OPEN_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
DOCTEST_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass(frozen=True)
class Block:
    """One fenced code block of a page."""

    page: Path
    lang: str
    code: str
    line: int
    """1-based line of the opening fence."""

    @property
    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"

    @property
    def snippets(self) -> list[str]:
        """The files this block includes, if it is made only of snippet lines."""
        lines = [line for line in self.code.splitlines() if line.strip()]
        matches = [SNIPPET.match(line) for line in lines]
        if lines and all(matches):
            return [m["path"] for m in matches if m]
        return []


def code_blocks(page: Path) -> list[Block]:
    """The fenced code blocks of a Markdown page, indented ones (admonitions, tabs) included."""
    lines = page.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = OPEN_FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = m["indent"], m["fence"]
        info = m["info"].strip()
        lang = info.split()[0].lstrip(".{").rstrip("}") if info else ""
        body: list[str] = []
        j = i + 1
        close = re.compile(rf"^{re.escape(indent)}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        while j < len(lines) and not close.match(lines[j]):
            line = lines[j]
            body.append(line[len(indent):] if line.startswith(indent) else line.lstrip())
            j += 1
        blocks.append(Block(page, lang.lower(), "\n".join(body) + "\n", i + 1))
        i = j + 1
    return blocks


def pages() -> list[Path]:
    """The pages whose code this module checks."""
    return sorted(p for p in DOCS.rglob("*.md")
                  if str(p.relative_to(DOCS)) not in OWNED_ELSEWHERE)


def pages_with_code() -> list[Path]:
    return [p for p in pages() if any(b.lang in RUN_LANGS and not b.snippets
                                      for b in code_blocks(p))]


def _stop_resources(namespace: dict[str, Any]) -> None:
    """Stop simulated fleets and close clients a page left open (also when it failed)."""
    from zml.sim import SimFleet

    for value in list(namespace.values()):
        if isinstance(value, SimFleet):
            value.stop()
        elif type(value).__name__ == "Client" and hasattr(value, "close"):
            value.close()


def run_page(page: Path, report: Callable[[str], None]) -> dict[str, Any]:
    """Run every python and pycon block of ``page`` in order; ``report`` gets each failure."""
    namespace: dict[str, Any] = {"__name__": "__docs__"}
    parser = doctest.DocTestParser()
    try:
        for block in code_blocks(page):
            if block.lang not in RUN_LANGS or block.snippets:
                continue
            if block.lang == "python":
                exec(compile(block.code, block.where, "exec", dont_inherit=True), namespace)
                continue
            test = parser.get_doctest(block.code, namespace, block.where, str(page), block.line)
            runner = doctest.DocTestRunner(optionflags=DOCTEST_FLAGS)
            runner.run(test, out=report, clear_globs=False)
            namespace.update(test.globs)
    finally:
        _stop_resources(namespace)
    return namespace


@pytest.fixture
def docs_folder(request: pytest.FixtureRequest, tmp_path: Path,
                monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[Path], Path]]:
    """Enter the folder a page runs in: empty, or with the seed fleet's ./zml.toml."""

    def enter(page: Path) -> Path:
        if SEED_MARKER in page.read_text(encoding="utf-8"):
            setup = request.getfixturevalue("seed_fleet")
            folder = setup.path.parent
        else:
            folder = tmp_path / "page"
            folder.mkdir()
        monkeypatch.chdir(folder)
        return folder

    yield enter


@pytest.mark.parametrize("page", pages_with_code(), ids=lambda p: str(p.relative_to(DOCS)))
def test_page_code_runs(page: Path, docs_folder: Callable[[Path], Path]) -> None:
    docs_folder(page)
    failures: list[str] = []
    run_page(page, failures.append)
    assert not failures, "\n".join(failures)


def test_there_is_code_to_run() -> None:
    assert len(pages_with_code()) >= 5


def test_no_python_hides_under_another_language_tag() -> None:
    bad = [f"{b.where}: ```{b.lang}" for p in pages() for b in code_blocks(p)
           if b.lang not in RUN_LANGS | OTHER_LANGS]
    assert not bad, "use ```python or ```pycon (run by this test), or a known non-code tag"


def test_included_code_comes_from_tested_files() -> None:
    """Snippet includes name files that exist: scripts of examples/ (run by their tests)."""
    for page in pages():
        for block in code_blocks(page):
            for path in block.snippets:
                assert (ROOT / path).is_file(), f"{block.where}: {path} does not exist"
                if block.lang in RUN_LANGS:
                    assert path.startswith("examples/"), (
                        f"{block.where}: Python shown in the docs comes from examples/ "
                        f"(run by tests) or is run by this test, not from {path}"
                    )


def _model_keys() -> dict[str, set[str]]:
    from zml.config import AcceleratorConfig, FaultConfig, NodeConfig, SimConfig
    from zml.policy import Policy

    return {
        "accelerators": set(AcceleratorConfig.model_fields),
        "nodes": set(NodeConfig.model_fields),
        "sim": set(SimConfig.model_fields),
        "faults": set(FaultConfig.model_fields),
        "policies": set(Policy.model_fields),
    }


def _check_toml(data: dict[str, Any], where: str) -> None:
    from zml.config import registry_from_mapping
    from zml.policy import validate_policy_tables

    keys = _model_keys()
    assert set(data) <= {"accelerators", "nodes", "policies", "gateway"}, f"{where}: unknown table"
    if "gateway" in data:
        from zml.config import Registry
        from zml.gateway.settings import gateway_settings

        gateway_settings(Registry(gateway=data["gateway"], source=where))
    for table in (data.get("accelerators") or {}).values():
        assert set(table) <= keys["accelerators"], f"{where}: {set(table)}"
    for node in data.get("nodes") or []:
        assert set(node) <= keys["nodes"], f"{where}: {set(node)}"
        sim = node.get("sim") or {}
        assert set(sim) <= keys["sim"], f"{where}: {set(sim)}"
        assert set(sim.get("faults") or {}) <= keys["faults"], f"{where}: {sim}"
    for table in (data.get("policies") or {}).values():
        assert set(table) <= keys["policies"] - {"name"}, f"{where}: {set(table)}"
    if data.get("accelerators"):
        # A whole configuration: it must load, policies included.
        registry = registry_from_mapping(data, source=where)
        validate_policy_tables(registry)


def test_toml_blocks_are_valid_configuration() -> None:
    checked = 0
    for page in pages():
        for block in code_blocks(page):
            if block.lang != "toml" or block.snippets:
                continue
            data = tomllib.loads(block.code)
            _check_toml(data, block.where)
            checked += 1
    assert checked >= 3


def test_the_readmes_toml_blocks_are_valid_configuration() -> None:
    """The repository's README and the one PyPI shows: a reader copies these first."""
    checked = 0
    for page in (ROOT / "README.md", ROOT / "zml_core" / "README.md"):
        for block in code_blocks(page):
            if block.lang == "toml":
                _check_toml(tomllib.loads(block.code), block.where)
                checked += 1
    assert checked >= 2
