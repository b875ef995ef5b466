"""MkDocs hook: links from a page to repository files outside ``docs/`` become plain text.

A page may point at files of the repository that the site does not contain (a source module,
an example folder), which reads well on a code host but is a broken link on the site, and
fails ``mkdocs build --strict``. This hook replaces such a link by its text, **only when the
target exists** in the repository: a link to a missing file is left alone, so strict mode still
reports it. Fenced code blocks are not touched.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

_LINK = re.compile(r"(?<!!)\[(?P<text>[^\]\n]+)\]\((?P<target>[^)\s]+)\)")


def _outside_docs(target: str, page_dir: Path, docs_dir: Path, root: Path) -> bool:
    if "://" in target or target.startswith(("#", "/", "mailto:")):
        return False
    path = (page_dir / target.split("#", 1)[0]).resolve()
    inside_docs = path == docs_dir or docs_dir in path.parents
    return not inside_docs and root in path.parents and path.exists()


def on_page_markdown(markdown: str, page: Any, config: Any, **kwargs: Any) -> str:
    """Unlink the page's links to existing repository files outside docs/."""
    docs_dir = Path(config["docs_dir"]).resolve()
    root = docs_dir.parent
    page_dir = (docs_dir / page.file.src_path).parent

    def unlink(match: re.Match[str]) -> str:
        if _outside_docs(match["target"], page_dir, docs_dir, root):
            return match["text"]
        return match.group(0)

    # Split on fences: even-numbered parts are prose, odd-numbered parts are code blocks.
    parts = re.split(r"(^[ \t]*(?:```|~~~)[^\n]*\n.*?^[ \t]*(?:```|~~~)[ \t]*$)", markdown,
                     flags=re.M | re.S)
    return "".join(_LINK.sub(unlink, part) if i % 2 == 0 else part
                   for i, part in enumerate(parts))
