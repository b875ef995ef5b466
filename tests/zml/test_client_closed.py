"""A call on a closed client is a typed error, raised before anything is routed or sent."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

import zml
from tests.conftest import MODEL

MSGS = [{"role": "user", "content": "hi"}]
TOML = """[accelerators.H100]
[[nodes]]
id = "n1"
family = "H100"
url = "http://127.0.0.1:9"
models = ["{model}"]
max_concurrency = 1
"""


class _Hooks:
    def __init__(self) -> None:
        self.seen: list[str] = []

    @zml.hookimpl
    def zml_request_started(self, call: Any, metadata: Any) -> None:
        self.seen.append("started")


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "zml.toml"
    path.write_text(TOML.format(model=MODEL))
    return path


def test_a_sync_client_refuses_calls_after_close(config: Path) -> None:
    client = zml.Client(config=config)
    hooks = _Hooks()
    client.plugins.register(hooks)
    client.close()
    with pytest.raises(zml.ClientConfigError, match="this Client is closed: build a new one"):
        client.infer(MODEL, MSGS)
    with pytest.raises(zml.ClientConfigError, match="is closed"):
        client.infer_stream(MODEL, MSGS)
    assert hooks.seen == []  # refused before the request started (no "cancelled" either)


def test_an_async_client_refuses_calls_after_aclose(config: Path) -> None:
    async def main() -> None:
        async with zml.AsyncClient(config=config) as client:
            pass
        with pytest.raises(zml.ClientConfigError, match="this AsyncClient is closed"):
            await client.infer(MODEL, MSGS)
        with pytest.raises(zml.ClientConfigError, match="is closed"):
            client.infer_stream(MODEL, MSGS)

    asyncio.run(main())
