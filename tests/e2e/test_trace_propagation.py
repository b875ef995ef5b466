"""Trace context reaches the nodes: a loopback node records the headers of every request.

The node is a real HTTP server on a loopback socket (``http.server``), so what is checked is
what went over the wire: inside a traced request each attempt carries the request span's W3C
``traceparent`` (through ``opentelemetry.propagate``, so the application's propagator is the
one used); outside one, no trace header at all.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import (
    CarrierT,
    Getter,
    Setter,
    TextMapPropagator,
    default_setter,
)
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import zml
from zml.plugins.default.otel import OpenTelemetryPlugin

MSGS = [{"role": "user", "content": "hi"}]


class RecordingNode:
    """An OpenAI-style node on a loopback port that records each request's headers."""

    def __init__(self, status: int = 200) -> None:
        self.status = status
        self.headers: list[dict[str, str]] = []
        node = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                node.headers.append({k.lower(): v for k, v in self.headers.items()})
                body = json.loads(self.rfile.read(int(self.headers["content-length"])))
                if node.status != 200:
                    self._send(node.status, "application/json",
                               json.dumps({"error": {"message": "busy"}}).encode())
                elif body.get("stream"):
                    chunks = [
                        {"choices": [{"index": 0, "delta": {"content": "hi"}}]},
                        {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
                        {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                                  "total_tokens": 2}},
                    ]
                    data = "".join(
                        "data: " + json.dumps({"id": "c", "object": "chat.completion.chunk",
                                               "created": 1, "model": body["model"], **c})
                        + "\n\n" for c in chunks
                    ) + "data: [DONE]\n\n"
                    self._send(200, "text/event-stream", data.encode())
                else:
                    self._send(200, "application/json", json.dumps({
                        "id": "c", "object": "chat.completion", "created": 1,
                        "model": body["model"],
                        "choices": [{"index": 0, "finish_reason": "stop",
                                     "message": {"role": "assistant", "content": "hi"}}],
                        "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                                  "total_tokens": 2},
                    }).encode())

            def _send(self, status: int, kind: str, data: bytes) -> None:
                self.send_response(status)
                self.send_header("content-type", kind)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __enter__(self) -> RecordingNode:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[tuple[Path, RecordingNode, RecordingNode]]:
    """Two loopback nodes in one policy chain: ``busy`` (first choice) and ``ok``."""
    with RecordingNode() as busy, RecordingNode() as ok:
        path = tmp_path / "zml.toml"
        path.write_text(f"""
[accelerators.H100]
[accelerators.L4]

[[nodes]]
id = "busy"
family = "H100"
url = "{busy.url}"
models = ["m"]
max_concurrency = 2

[[nodes]]
id = "ok"
family = "L4"
url = "{ok.url}"
models = ["m"]
max_concurrency = 2

[policies.chain]
accelerator_chain = ["H100", "L4"]
""")
        yield path, busy, ok


@pytest.fixture
def traced() -> tuple[OpenTelemetryPlugin, InMemorySpanExporter, TracerProvider]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return OpenTelemetryPlugin(tracer_provider=provider), exporter, provider


def run(kind: str, config: Path, plugin: Any, *, stream: bool = False,
        parent: Any = None) -> None:
    """One request (sync or async client) through ``plugin``, inside ``parent`` if given."""
    ctx = trace.set_span_in_context(parent) if parent is not None else None

    if kind == "sync":
        with zml.Client(config=config) as client:
            client.plugins.unregister(name="zml.otel")
            if plugin is not None:
                client.plugins.register(plugin, name="zml.otel")
            token = None if ctx is None else _attach(ctx)
            try:
                if stream:
                    with client.infer_stream(model="m", messages=MSGS, policy="chain") as s:
                        list(s)
                else:
                    client.infer(model="m", messages=MSGS, policy="chain")
            finally:
                _detach(token)
        return

    async def main() -> None:
        async with zml.AsyncClient(config=config) as client:
            client.plugins.unregister(name="zml.otel")
            if plugin is not None:
                client.plugins.register(plugin, name="zml.otel")
            token = None if ctx is None else _attach(ctx)
            try:
                if stream:
                    async with client.infer_stream(model="m", messages=MSGS,
                                                   policy="chain") as s:
                        async for _ in s:
                            pass
                else:
                    await client.infer(model="m", messages=MSGS, policy="chain")
            finally:
                _detach(token)

    asyncio.run(main())


def _attach(ctx: Context) -> object:
    from opentelemetry import context

    return context.attach(ctx)


def _detach(token: object) -> None:
    if token is not None:
        from opentelemetry import context

        context.detach(token)  # type: ignore[arg-type]


def traceparent(headers: dict[str, str]) -> tuple[str, str, bool]:
    """(trace id, parent span id, sampled) of a W3C traceparent header."""
    version, trace_id, span_id, flags = headers["traceparent"].split("-")
    assert version == "00"
    return trace_id, span_id, bool(int(flags, 16) & 1)


@pytest.mark.parametrize("stream", [False, True], ids=["infer", "stream"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_each_attempt_of_a_traced_call_sends_the_span_traceparent(
    fleet: tuple[Path, RecordingNode, RecordingNode], traced: Any, kind: str, stream: bool
) -> None:
    config, busy, ok = fleet
    busy.status = 503  # the first attempt fails over to ``ok``
    plugin, exporter, provider = traced
    app = provider.get_tracer("app").start_span("handle request")
    run(kind, config, plugin, stream=stream, parent=app)
    app.end()
    (zml_span,) = [s for s in exporter.get_finished_spans() if s.name == "chat m"]
    assert zml_span.parent is not None
    assert zml_span.parent.span_id == app.get_span_context().span_id
    want = (f"{zml_span.context.trace_id:032x}", f"{zml_span.context.span_id:016x}", True)
    assert len(busy.headers) == 1 and len(ok.headers) == 1
    assert traceparent(busy.headers[0]) == want
    assert traceparent(ok.headers[0]) == want
    assert want[0] == f"{app.get_span_context().trace_id:032x}"  # the caller's trace


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_no_trace_header_outside_a_traced_call(
    fleet: tuple[Path, RecordingNode, RecordingNode], kind: str
) -> None:
    config, busy, ok = fleet
    busy.status = 503
    # a plugin whose provider traces nothing (what the API gives without an SDK) ...
    run(kind, config, OpenTelemetryPlugin(tracer_provider=trace.NoOpTracerProvider()))
    # ... and no telemetry plugin at all
    run(kind, config, None)
    assert len(busy.headers) == 2 and len(ok.headers) == 2
    for headers in busy.headers + ok.headers:
        assert "traceparent" not in headers and "tracestate" not in headers


class TenantPropagator(TextMapPropagator):
    """A stand-in for an application's own propagator (B3, Jaeger...): one header."""

    def extract(self, carrier: CarrierT, context: Context | None = None,
                getter: Getter[CarrierT] | None = None) -> Context:
        return context or Context()

    def inject(self, carrier: CarrierT, context: Context | None = None,
               setter: Setter[CarrierT] = default_setter) -> None:
        span = trace.get_current_span(context)
        setter.set(carrier, "x-test-trace", f"{span.get_span_context().trace_id:032x}")

    @property
    def fields(self) -> set[str]:
        return {"x-test-trace"}


def test_the_application_propagator_is_the_one_used(
    fleet: tuple[Path, RecordingNode, RecordingNode], traced: Any
) -> None:
    config, busy, ok = fleet
    busy.status = 503
    plugin, exporter, _ = traced
    previous = propagate.get_global_textmap()
    propagate.set_global_textmap(TenantPropagator())
    try:
        run("sync", config, plugin)
    finally:
        propagate.set_global_textmap(previous)
    (span,) = exporter.get_finished_spans()
    for headers in busy.headers + ok.headers:
        assert headers["x-test-trace"] == f"{span.context.trace_id:032x}"
        assert "traceparent" not in headers


class TenantHeaders:
    """A plugin adding its own headers, one of which would replace zml's authorization."""

    @zml.hookimpl
    def zml_request_headers(self, routing: Any, headers: dict[str, str]) -> None:
        headers["x-tenant"] = f"t-{routing.node_id}"
        headers["Authorization"] = "Bearer not-the-key"


class Broken:
    @zml.hookimpl
    def zml_request_headers(self, headers: dict[str, str]) -> None:
        raise RuntimeError("plugin bug")


def test_plugins_add_headers_but_never_replace_zml_s_own(
    fleet: tuple[Path, RecordingNode, RecordingNode]
) -> None:
    config, busy, ok = fleet
    busy.status = 503
    with zml.Client(config=config, api_key="the-key") as client:
        client.plugins.register(Broken(), name="broken")  # isolated: logged, not raised
        client.plugins.register(TenantHeaders(), name="tenant")
        client.infer(model="m", messages=MSGS, policy="chain")
    assert [h["x-tenant"] for h in busy.headers + ok.headers] == ["t-busy", "t-ok"]
    assert [h["authorization"] for h in busy.headers + ok.headers] == ["Bearer the-key"] * 2


class UnsendableHeaders:
    """Adds headers no HTTP stack can send as they are, next to a good one."""

    @zml.hookimpl
    def zml_request_headers(self, headers: dict[str, str]) -> None:
        headers["x-team"] = "équipe"  # not ASCII
        headers["x-split"] = "a\r\nx-injected: 1"  # a line break would split the header
        headers["bad name"] = "v"  # not a token
        headers["x-good"] = "yes"


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_header_a_plugin_cannot_send_is_dropped_and_logged_and_the_request_goes_on(
    fleet: tuple[Path, RecordingNode, RecordingNode], kind: str,
    caplog: pytest.LogCaptureFixture
) -> None:
    config, first, second = fleet
    caplog.set_level("WARNING", logger="zml.plugins")

    async def main() -> str | None:
        async with zml.AsyncClient(config=config) as client:
            client.plugins.register(UnsendableHeaders(), name="unsendable")
            r = await client.infer(model="m", messages=MSGS, policy="chain")
            return r.choices[0].message.content

    if kind == "sync":
        with zml.Client(config=config) as client:
            client.plugins.register(UnsendableHeaders(), name="unsendable")
            content = client.infer(model="m", messages=MSGS, policy="chain") \
                .choices[0].message.content
    else:
        content = asyncio.run(main())
    assert content == "hi"
    (sent,) = first.headers + second.headers
    assert sent["x-good"] == "yes"
    assert not {"x-team", "x-split", "x-injected", "bad name"} & set(sent)
    (record,) = [r for r in caplog.records if "zml_request_headers" in r.getMessage()]
    assert record.exc_info is not None and "'x-team', 'x-split', 'bad name'" in str(
        record.exc_info[1])
    assert "équipe" not in caplog.text  # names only: a value may hold a secret
