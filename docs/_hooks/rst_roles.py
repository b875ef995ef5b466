"""MkDocs hook: render the reStructuredText roles of zml's docstrings as plain code.

zml's docstrings are Google style, with Sphinx cross-reference roles here and there
(:class:`zml.Policy`, :meth:`Client.infer`, ``~`` for a short name). mkdocstrings renders the
backquoted part as code and leaves the role name as text; this drops the role name (and the
``~``) so that ``:class:`~zml.types.ChatCompletionChunk``` reads ``zml.types.ChatCompletionChunk``.
Local, offline, and only touching text right before an inline code element.
"""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:class|meth|mod|func|data|attr|exc|obj):(<code[^>]*>)~?")


def on_page_content(html: str, **kwargs: Any) -> str:
    """Drop role prefixes before inline code in a page's rendered content."""
    return _ROLE.sub(r"\1", html)
