"""Shared by the plugin tests: a scripted MockTransport fleet and one driver for both clients.

``driver`` is parametrised over the sync and the async client, so each test that uses it runs
once per client: the hooks must fire alike for both.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx2
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import zml
from zml.plugins.default.otel import OpenTelemetryPlugin

MODEL = "m"
MSGS = [{"role": "user", "content": "secret prompt text"}]

CONFIG = """
[accelerators.H100]
cost_per_hour = 3.6

[accelerators.MI300X]
cost_per_1k_tokens = 0.5

[accelerators.A10]

[[nodes]]
id = "h100-a"
family = "H100"
url = "http://h100-a:8000"
models = ["m"]
max_concurrency = 2

[[nodes]]
id = "mi-a"
family = "MI300X"
url = "http://mi-a:8001"
models = ["m"]
max_concurrency = 4

[[nodes]]
id = "a10-a"
family = "A10"
url = "http://a10-a:8002"
models = ["m"]
max_concurrency = 1

[policies.prod]
accelerator_chain = ["H100", "MI300X"]

[policies.h100only]
accelerator_chain = ["H100"]

[policies.cheap]
accelerator_chain = ["A10"]
"""


def completion(model: str, host: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": f"from {host}"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8},
    }


def sse(model: str) -> bytes:
    chunks = [
        {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "he"}}]},
        {"choices": [{"index": 0, "delta": {"content": "llo"}, "finish_reason": "stop"}]},
        {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 2,
                                  "total_tokens": 5}},
    ]
    events = [
        json.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1,
                    "model": model, **c})
        for c in chunks
    ]
    return "".join(f"data: {e}\n\n" for e in [*events, "[DONE]"]).encode()


class Nodes:
    """A scripted fleet: per host, the HTTP status to answer (200 by default)."""

    def __init__(self) -> None:
        self.status: dict[str, int] = {}
        self.hosts: list[str] = []
        self.answer: dict[str, Callable[[dict[str, Any]], httpx2.Response]] = {}
        """Per host, a function of the request body giving the answer (instead of the usual)."""
        self.headers: list[httpx2.Headers] = []

    def handler(self, request: httpx2.Request) -> httpx2.Response:
        host = request.url.host
        self.hosts.append(host)
        self.headers.append(request.headers)
        body = json.loads(request.content)
        status = self.status.get(host, 200)
        if status != 200:
            return httpx2.Response(status, json={"error": {"message": f"status {status}"}})
        if host in self.answer:
            return self.answer[host](body)
        if body.get("stream"):
            return httpx2.Response(200, content=sse(body["model"]),
                                   headers={"content-type": "text/event-stream"})
        return httpx2.Response(200, json=completion(body["model"], host))


class Driver:
    """One client of the parametrised kind, with sync-looking ``infer`` and ``stream``."""

    def __init__(self, kind: str, config: Path, nodes: Nodes) -> None:
        self.kind = kind
        transport = httpx2.MockTransport(nodes.handler)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.client: zml.Client | zml.AsyncClient
        if kind == "sync":
            self.client = zml.Client(config=config, http_client=httpx2.Client(transport=transport))
        else:
            self.loop = asyncio.new_event_loop()
            self.client = zml.AsyncClient(
                config=config, http_client=httpx2.AsyncClient(transport=transport)
            )

    @property
    def plugins(self) -> Any:
        return self.client.plugins

    def infer(self, **kwargs: Any) -> zml.ChatCompletion:
        kwargs.setdefault("model", MODEL)
        kwargs.setdefault("messages", MSGS)
        if isinstance(self.client, zml.Client):
            return self.client.infer(**kwargs)
        assert self.loop is not None
        return self.loop.run_until_complete(self.client.infer(**kwargs))

    def stream(self, stop_after: int | None = None, **kwargs: Any) -> tuple[Any, list[Any]]:
        """Stream a request; with ``stop_after``, close the stream after that many chunks."""
        kwargs.setdefault("model", MODEL)
        kwargs.setdefault("messages", MSGS)
        chunks: list[Any] = []
        if isinstance(self.client, zml.Client):
            with self.client.infer_stream(**kwargs) as stream:
                for chunk in stream:
                    chunks.append(chunk)
                    if stop_after is not None and len(chunks) >= stop_after:
                        break
            return stream, chunks
        client = self.client

        async def main() -> Any:
            async with client.infer_stream(**kwargs) as stream:
                async for chunk in stream:
                    chunks.append(chunk)
                    if stop_after is not None and len(chunks) >= stop_after:
                        break
            return stream

        assert self.loop is not None
        return self.loop.run_until_complete(main()), chunks

    def close(self) -> None:
        if isinstance(self.client, zml.Client):
            self.client.close()
        else:
            assert self.loop is not None
            self.loop.run_until_complete(self.client.aclose())
            self.loop.close()


@pytest.fixture
def config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The fleet's zml.toml, also the discovered one (so ``zml.Policy(...)`` validates)."""
    path = tmp_path / "zml.toml"
    path.write_text(CONFIG)
    monkeypatch.setenv("ZML_CONFIG", str(path))
    return path


@pytest.fixture
def nodes() -> Nodes:
    return Nodes()


@pytest.fixture(params=["sync", "async"])
def make_driver(
    request: pytest.FixtureRequest, config: Path, nodes: Nodes
) -> Iterator[Callable[..., Driver]]:
    """Factory of drivers of the parametrised client kind (closed after the test)."""
    made: list[Driver] = []

    def make(path: Path | None = None) -> Driver:
        driver = Driver(request.param, path or config, nodes)
        made.append(driver)
        return driver

    yield make
    for driver in made:
        driver.close()


@pytest.fixture
def driver(make_driver: Callable[..., Driver]) -> Driver:
    return make_driver()


@pytest.fixture
def otel() -> SimpleNamespace:
    """An OpenTelemetry plugin on SDK providers with in-memory span and metric readers."""
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    reader = InMemoryMetricReader()
    meter_provider = MeterProvider(metric_readers=[reader])
    plugin = OpenTelemetryPlugin(tracer_provider=tracer_provider, meter_provider=meter_provider)
    return SimpleNamespace(exporter=exporter, reader=reader, plugin=plugin)


class Recorder:
    """A telemetry plugin that records every hook call (name and arguments)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []

    def names(self) -> list[str]:
        return [name for name, _ in self.events]

    @zml.hookimpl
    def zml_request_started(self, call: Any, metadata: Any) -> None:
        self.events.append(("started", {"call": call, "metadata": metadata}))

    @zml.hookimpl
    def zml_request_routed(self, call: Any, routing: Any, metadata: Any) -> None:
        self.events.append(("routed", {"routing": routing, "metadata": metadata}))

    @zml.hookimpl
    def zml_attempt_failed(self, attempt: Any, error: Any, metadata: Any) -> None:
        self.events.append(("attempt_failed", {"attempt": attempt, "error": error,
                                               "metadata": metadata}))

    @zml.hookimpl
    def zml_request_completed(self, routing: Any, usage: Any, held_s: float, cost: Any,
                              metadata: Any) -> None:
        self.events.append(("completed", {"routing": routing, "usage": usage,
                                          "held_s": held_s, "cost": cost,
                                          "metadata": metadata}))

    @zml.hookimpl
    def zml_request_failed(self, error: Any, metadata: Any) -> None:
        self.events.append(("failed", {"error": error, "metadata": metadata}))

    @zml.hookimpl
    def zml_request_cancelled(self, metadata: Any) -> None:
        self.events.append(("cancelled", {"metadata": metadata}))


@pytest.fixture
def recorder() -> Recorder:
    return Recorder()


def use_otel(driver: Driver, otel: SimpleNamespace) -> None:
    """Replace the client's built-in OpenTelemetry plugin with the in-memory one."""
    driver.plugins.unregister(name="zml.otel")
    driver.plugins.register(otel.plugin, name="zml.otel")


@pytest.fixture
def traced(driver: Driver, otel: SimpleNamespace) -> SimpleNamespace:
    """The driver, with its telemetry going to ``otel``'s in-memory readers."""
    use_otel(driver, otel)
    return SimpleNamespace(driver=driver, exporter=otel.exporter, reader=otel.reader)
