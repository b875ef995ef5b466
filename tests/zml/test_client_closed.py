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


class _Endings:
    def __init__(self) -> None:
        self.seen: list[str] = []

    @zml.hookimpl
    def zml_request_failed(self, error: Any) -> None:
        self.seen.append(f"failed:{type(error).__name__}")

    @zml.hookimpl
    def zml_request_cancelled(self) -> None:
        self.seen.append("cancelled")


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_http_client_of_yours_closed_before_the_call_is_a_typed_failure(
    config: Path, kind: str, stream: bool
) -> None:
    """httpx2 raises a RuntimeError for a send on a closed client: it reached the caller raw,
    and plugins and telemetry heard of a *cancelled* request."""
    import httpx2

    endings = _Endings()

    def check(error: BaseException) -> None:
        assert isinstance(error, zml.ClientConfigError) and error.param == "http_client"
        assert "has been closed" in str(error) and "pass an open one" in str(error)
        assert endings.seen == ["failed:ClientConfigError"]

    if kind == "sync":
        http = httpx2.Client()
        http.close()
        with zml.Client(config=config, http_client=http) as client:
            client.plugins.register(endings, name="endings")
            with pytest.raises(zml.ClientConfigError) as info:
                if stream:
                    list(client.infer_stream(MODEL, MSGS))
                else:
                    client.infer(MODEL, MSGS)
            check(info.value)
            assert client.fleet.in_flight == 0
        return

    async def main() -> None:
        http = httpx2.AsyncClient()
        await http.aclose()
        async with zml.AsyncClient(config=config, http_client=http,
                                   probe_interval_s=None) as client:
            client.plugins.register(endings, name="endings")
            with pytest.raises(zml.ClientConfigError) as info:
                if stream:
                    async for _ in client.infer_stream(MODEL, MSGS):
                        pass
                else:
                    await client.infer(MODEL, MSGS)
            check(info.value)
            assert client.fleet.in_flight == 0

    asyncio.run(main())
