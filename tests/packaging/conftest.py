"""Packaging tests build the distributions and install them into fresh virtual environments."""

from __future__ import annotations

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "install: installs a package into a fresh virtual environment (uses uv)"
    )
