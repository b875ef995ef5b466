"""The public names of langchain_zml."""

from __future__ import annotations

import langchain_zml

EXPECTED_ALL = ["ChatZML"]


def test_all_imports() -> None:
    assert sorted(langchain_zml.__all__) == sorted(EXPECTED_ALL)
    for name in EXPECTED_ALL:
        assert getattr(langchain_zml, name) is not None
