"""Fixtures of the end-to-end tests: the hostile node (see tests/e2e/hostile.py)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.hostile import HostileNode, serving


@pytest.fixture
def hostile() -> Iterator[HostileNode]:
    """A hostile node on a free loopback port; ``hostile.url("keepalive")`` is one of its nodes."""
    with serving() as node:
        yield node
