"""A zml.toml and a MockTransport fleet for the zml-policy-sqlite tests."""

from __future__ import annotations

import contextlib
import json
import sqlite3
from collections.abc import Iterator
from pathlib import Path

import httpx2
import pytest

CONFIG = """
[accelerators.H100]
cost_per_hour = 3.6
[accelerators.MI300X]
cost_per_hour = 2.0

[[nodes]]
id = "h100-a"
family = "H100"
url = "http://h100-a:8000"
models = ["m"]
max_concurrency = 2

[[nodes]]
id = "mi-a"
family = "MI300X"
url = "http://mi-a:8000"
models = ["m"]
max_concurrency = 2

[policies.prod]
accelerator_chain = ["H100", "MI300X"]
"""


def answer(request: httpx2.Request) -> httpx2.Response:
    body = json.loads(request.content)
    return httpx2.Response(200, json={
        "id": "c", "object": "chat.completion", "created": 1, "model": body["model"],
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    })


@contextlib.contextmanager
def locked(path: Path) -> Iterator[sqlite3.Connection]:
    """Another connection holding the database with ``BEGIN EXCLUSIVE`` (nobody else reads)."""
    conn = sqlite3.connect(path, isolation_level=None)
    try:
        conn.execute("BEGIN EXCLUSIVE")
        yield conn
        conn.execute("ROLLBACK")
    finally:
        conn.close()


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "zml.toml"
    path.write_text(CONFIG)
    return path


@pytest.fixture
def db(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A database path, announced to clients through ZML_POLICY_SQLITE_DB."""
    path = tmp_path / "policies.db"
    monkeypatch.setenv("ZML_POLICY_SQLITE_DB", str(path))
    yield path
    from zml_policy_sqlite.plugin import source_for

    source_for(str(path)).close()
