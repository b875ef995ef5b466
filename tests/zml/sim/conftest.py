"""Shared helpers for the simulated-node tests: node factories, in-process clients, SSE reading."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from types import SimpleNamespace
from typing import Any

import httpx2
import pytest

from zml.sim import SimNode, SimNodeSpec

FAST = 0.001


def spec(**overrides: Any) -> SimNodeSpec:
    fields: dict[str, Any] = {
        "id": "n1",
        "family": "H100",
        "models": ("m1",),
        "max_concurrency": 4,
    }
    fields.update(overrides)
    return SimNodeSpec(**fields)


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


async def read_sse(response: httpx2.Response) -> list[str]:
    """Every event's data, in order, until the stream ends (or fails)."""
    return [event.data async for event in httpx2.EventSource(response)]


async def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.005)


@pytest.fixture
def make_node() -> Callable[..., SimNode]:
    def make(time_scale: float = FAST, **overrides: Any) -> SimNode:
        return SimNode(spec(**overrides), time_scale=time_scale)

    return make


@pytest.fixture
async def client_for() -> AsyncIterator[Callable[[SimNode], httpx2.AsyncClient]]:
    clients: list[httpx2.AsyncClient] = []

    def make(node: SimNode) -> httpx2.AsyncClient:
        client = httpx2.AsyncClient(transport=httpx2.ASGITransport(app=node), base_url="http://sim")
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.aclose()


@pytest.fixture
def chat() -> Callable[..., Awaitable[httpx2.Response]]:
    async def post(client: httpx2.AsyncClient, **body: Any) -> httpx2.Response:
        body.setdefault("model", "m1")
        body.setdefault("messages", user("Hello there"))
        return await client.post("/v1/chat/completions", json=body)

    return post


@pytest.fixture
def stream() -> Callable[..., Awaitable[list[str]]]:
    async def run(client: httpx2.AsyncClient, **body: Any) -> list[str]:
        body.setdefault("model", "m1")
        body.setdefault("messages", user("Hello there"))
        body["stream"] = True
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            assert response.headers["content-type"].startswith("text/event-stream")
            return await read_sse(response)

    return run


def chunks(events: list[str]) -> list[dict[str, Any]]:
    """The JSON chunks of a finished stream (without the final [DONE])."""
    assert events[-1] == "[DONE]"
    return [json.loads(data) for data in events[:-1]]


def streamed_content(events: list[str]) -> str:
    return "".join(
        c["choices"][0]["delta"].get("content") or ""
        for c in chunks(events)
        if c["choices"]
    )


class RawConnection:
    """Drives a node's ASGI app directly, so a test decides when the client disconnects."""

    def __init__(self, node: SimNode, body: dict[str, Any], path: str = "/v1/chat/completions") -> None:
        self.sent: list[dict[str, Any]] = []
        self._gone = asyncio.Event()
        self._body = json.dumps(body).encode()
        self._delivered = False
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": "POST",
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        self.task = asyncio.ensure_future(node(scope, self._receive, self._send))

    async def _receive(self) -> dict[str, Any]:
        if not self._delivered:
            self._delivered = True
            return {"type": "http.request", "body": self._body, "more_body": False}
        await self._gone.wait()
        return {"type": "http.disconnect"}

    async def _send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def disconnect(self) -> None:
        self._gone.set()

    @property
    def status(self) -> int | None:
        for message in self.sent:
            if message["type"] == "http.response.start":
                return int(message["status"])
        return None

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.sent if m["type"] == "http.response.body")

    @property
    def complete(self) -> bool:
        return any(
            m["type"] == "http.response.body" and not m.get("more_body", False) for m in self.sent
        )


@pytest.fixture
def tk() -> SimpleNamespace:
    """The plain helpers of this module (test modules cannot import a conftest)."""
    return SimpleNamespace(
        FAST=FAST,
        spec=spec,
        user=user,
        read_sse=read_sse,
        wait_for=wait_for,
        chunks=chunks,
        streamed_content=streamed_content,
        RawConnection=RawConnection,
    )
