"""The built-in OpenTelemetry plugin: spans, events and metrics per the GenAI conventions.

Each test runs for the sync and the async client. Providers are passed to the plugin instance
(the global ones can be set only once per process).
"""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest
from opentelemetry.trace import SpanKind, StatusCode

import zml

from .conftest import MSGS, Nodes


def only_span(t: SimpleNamespace) -> Any:
    spans = t.exporter.get_finished_spans()
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


def events(span: Any, name: str) -> list[dict[str, Any]]:
    return [dict(e.attributes) for e in span.events if e.name == name]


def points(reader: Any, metric: str) -> list[Any]:
    data = reader.get_metrics_data()
    found = []
    for rm in data.resource_metrics if data else ():
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                if m.name == metric:
                    assert sm.scope.name == "zml"
                    found.extend(m.data.data_points)
    return found


def test_success_span_attributes_events_and_metrics(traced: SimpleNamespace) -> None:
    r = traced.driver.infer(policy="prod", metadata={"team": "search"})
    assert r.routing.node_id == "h100-a"
    span = only_span(traced)
    assert span.name == "chat m"
    assert span.kind == SpanKind.CLIENT
    a = span.attributes
    assert a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.provider.name"] == "zml" and a["gen_ai.system"] == "zml"
    assert a["gen_ai.request.model"] == "m" and a["gen_ai.response.model"] == "m"
    assert a["gen_ai.usage.input_tokens"] == 3 and a["gen_ai.usage.output_tokens"] == 5
    assert a["server.address"] == "h100-a" and a["server.port"] == 8000
    assert a["zml.policy"] == "prod" and a["zml.accelerator"] == "H100"
    assert a["zml.node_id"] == "h100-a" and a["zml.queue_depth"] == 0
    assert a["zml.attempts"] == 1
    assert a["zml.cost.basis"] == "node_seconds" and a["zml.cost.amount"] >= 0
    assert span.status.status_code == StatusCode.UNSET
    assert events(span, "zml.route.family") == [
        {"zml.family": "H100", "zml.nodes_checked": 1}
    ]
    assert events(span, "zml.attempt.failed") == []
    assert "secret prompt text" not in json.dumps(dict(a))

    (duration,) = points(traced.reader, "gen_ai.client.operation.duration")
    assert duration.count == 1 and duration.sum >= 0
    assert duration.attributes["gen_ai.operation.name"] == "chat"
    assert duration.attributes["gen_ai.request.model"] == "m"
    assert duration.attributes["server.address"] == "h100-a"
    assert duration.attributes["server.port"] == 8000
    assert "error.type" not in duration.attributes
    # not a stream: no stream flag, no time-to-first-chunk (the conventions: streams only)
    assert "gen_ai.request.stream" not in a
    assert "gen_ai.response.time_to_first_chunk" not in a
    assert "zml.ttft_s" not in a  # a whole answer shows no first token
    assert points(traced.reader, "gen_ai.client.operation.time_to_first_chunk") == []
    tokens = {p.attributes["gen_ai.token.type"]: p.sum
              for p in points(traced.reader, "gen_ai.client.token.usage")}
    assert tokens == {"input": 3, "output": 5}


def test_fallback_span_has_failed_attempt_and_both_decisions(
    traced: SimpleNamespace, nodes: Nodes
) -> None:
    nodes.status["h100-a"] = 503
    r = traced.driver.infer(policy="prod")
    assert r.routing.accelerator == "MI300X"
    assert [a.node_id for a in r.routing.attempts] == ["h100-a"]
    span = only_span(traced)
    a = span.attributes
    assert a["zml.accelerator"] == "MI300X" and a["zml.node_id"] == "mi-a"
    assert a["server.address"] == "mi-a" and a["zml.attempts"] == 2
    assert a["zml.cost.basis"] == "tokens" and a["zml.cost.amount"] == pytest.approx(0.004)
    assert events(span, "zml.attempt.failed") == [
        {"zml.attempt": 1, "zml.node_id": "h100-a", "zml.accelerator": "H100",
         "error.type": "unavailable", "http.response.status_code": 503}
    ]
    # the first decision chose H100; the second rejected it (tried) and chose MI300X
    assert events(span, "zml.route.family") == [
        {"zml.family": "H100", "zml.nodes_checked": 1},
        {"zml.family": "H100", "zml.nodes_checked": 1,
         "zml.rejected_reason": "excluded_after_failure"},
        {"zml.family": "MI300X", "zml.nodes_checked": 1},
    ]
    assert span.status.status_code == StatusCode.UNSET


def test_routing_error_no_viable_node(traced: SimpleNamespace) -> None:
    with pytest.raises(zml.RoutingError) as info:
        traced.driver.infer(model="not-served", policy="prod")
    assert info.value.routing_context["final_error"] == "no_viable_node"
    span = only_span(traced)
    assert span.name == "chat not-served"
    assert span.status.status_code == StatusCode.ERROR
    assert "no_viable_node" in span.status.description
    assert span.attributes["error.type"] == "RoutingError"
    assert span.attributes["zml.final_error"] == "no_viable_node"
    assert span.attributes["zml.policy"] == "prod"
    families = events(span, "zml.route.family")
    assert [e["zml.family"] for e in families] == ["H100", "MI300X"]
    assert all("zml.rejected_reason" in e for e in families)
    assert events(span, "exception")
    (duration,) = points(traced.reader, "gen_ai.client.operation.duration")
    assert duration.attributes["error.type"] == "RoutingError"
    assert points(traced.reader, "gen_ai.client.token.usage") == []


def test_routing_error_after_failed_attempts(traced: SimpleNamespace, nodes: Nodes) -> None:
    nodes.status["h100-a"] = 503
    with pytest.raises(zml.RoutingError) as info:
        traced.driver.infer(policy="h100only")
    assert info.value.routing_context["final_error"] == "attempts_exhausted"
    span = only_span(traced)
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["error.type"] == "RoutingError"
    assert span.attributes["zml.final_error"] == "attempts_exhausted"
    assert len(events(span, "zml.attempt.failed")) == 1
    assert [e["zml.family"] for e in events(span, "zml.route.family")] == ["H100"]


def test_node_error_sets_error_type(traced: SimpleNamespace, nodes: Nodes) -> None:
    nodes.status["h100-a"] = 400
    with pytest.raises(zml.BadRequestError):
        traced.driver.infer(policy="prod")
    span = only_span(traced)
    assert span.status.status_code == StatusCode.ERROR
    assert span.attributes["error.type"] == "BadRequestError"


def test_stream_span_ends_after_the_last_chunk(traced: SimpleNamespace) -> None:
    stream, chunks = traced.driver.stream(policy="prod")
    assert len(chunks) >= 2
    span = only_span(traced)
    assert span.name == "chat m"
    assert span.attributes["gen_ai.usage.output_tokens"] == 2
    assert span.attributes["zml.node_id"] == "h100-a"
    assert span.attributes["gen_ai.request.stream"] is True
    ttfc = span.attributes["gen_ai.response.time_to_first_chunk"]
    node_ttft = span.attributes["zml.ttft_s"]
    # from the call (queueing included) >= from sending, on the node that answered
    assert isinstance(ttfc, float) and 0 <= node_ttft <= ttfc
    assert stream.routing.cost is not None
    (first_chunk,) = points(traced.reader, "gen_ai.client.operation.time_to_first_chunk")
    assert first_chunk.count == 1 and first_chunk.sum == pytest.approx(ttfc)
    assert first_chunk.attributes["server.address"] == "h100-a"
    assert first_chunk.attributes["server.port"] == 8000
    assert first_chunk.attributes["gen_ai.request.model"] == "m"


def test_request_parameters_become_gen_ai_request_attributes(traced: SimpleNamespace) -> None:
    traced.driver.infer(policy="prod", max_tokens=64, temperature=0.2, top_p=0.9, seed=7,
                        stop=["END"], presence_penalty=0.5,
                        response_format={"type": "json_object"})
    a = only_span(traced).attributes
    assert a["gen_ai.request.max_tokens"] == 64
    assert a["gen_ai.request.temperature"] == 0.2 and a["gen_ai.request.top_p"] == 0.9
    assert a["gen_ai.request.seed"] == 7
    assert a["gen_ai.request.stop_sequences"] == ("END",)
    assert a["gen_ai.request.presence_penalty"] == 0.5
    assert a["gen_ai.output.type"] == "json"
    for unset in ("gen_ai.request.frequency_penalty", "gen_ai.request.choice.count"):
        assert unset not in a


def test_stream_closed_early_is_cancelled_not_error(traced: SimpleNamespace) -> None:
    traced.driver.stream(stop_after=1, policy="prod")
    span = only_span(traced)
    assert span.attributes["zml.cancelled"] is True
    assert span.status.status_code == StatusCode.UNSET


def test_a_cancelled_request_records_its_duration_with_error_type_cancelled(
    traced: SimpleNamespace,
) -> None:
    # The GenAI conventions record every operation's duration, a failed one with error.type:
    # a request the caller cancelled says so, as its span does (zml.cancelled).
    traced.driver.stream(stop_after=1, policy="prod")
    assert only_span(traced).attributes["zml.cancelled"] is True
    (duration,) = points(traced.reader, "gen_ai.client.operation.duration")
    assert duration.count == 1 and duration.sum >= 0
    a = duration.attributes
    assert a["error.type"] == "cancelled"
    assert a["gen_ai.operation.name"] == "chat" and a["gen_ai.request.model"] == "m"
    # counted under the node that had the request when it was cancelled
    assert a["server.address"] == "h100-a" and a["server.port"] == 8000
    assert a["zml.accelerator"] == "H100" and a["zml.policy"] == "prod"
    assert "gen_ai.response.model" not in a  # no answer came to say which model answered


@pytest.mark.parametrize("make_driver", ["async"], indirect=True)  # a task: the async client's
def test_a_cancelled_task_records_its_duration_with_error_type_cancelled(
    traced: SimpleNamespace, nodes: Nodes,
) -> None:
    driver = traced.driver
    assert driver.kind == "async"
    import asyncio

    async def never() -> Any:
        await asyncio.Event().wait()

    nodes.answer["h100-a"] = lambda body: never()  # the node never answers

    async def main() -> None:
        task = asyncio.ensure_future(driver.client.infer(model="m", messages=MSGS,
                                                         policy="prod"))
        while not nodes.hosts:  # sent: the node has it
            await asyncio.sleep(0.001)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    driver.loop.run_until_complete(main())
    assert only_span(traced).attributes["zml.cancelled"] is True
    (duration,) = points(traced.reader, "gen_ai.client.operation.duration")
    assert duration.count == 1
    assert duration.attributes["error.type"] == "cancelled"
    assert duration.attributes["server.address"] == "h100-a"


def test_content_captured_only_when_opted_in(
    traced: SimpleNamespace, otel: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    traced.driver.infer(policy="prod")
    monkeypatch.setenv("ZML_TELEMETRY_CAPTURE_CONTENT", "1")
    traced.driver.infer(policy="prod")
    first, second = traced.exporter.get_finished_spans()
    assert "gen_ai.input.messages" not in first.attributes
    assert json.loads(second.attributes["gen_ai.input.messages"]) == [
        {"role": "user", "parts": [{"type": "text", "content": "secret prompt text"}]}
    ]


def test_without_configured_providers_nothing_is_recorded(driver: Any) -> None:
    from opentelemetry import trace

    from zml.plugins.default.otel import OpenTelemetryPlugin

    plugin = OpenTelemetryPlugin()  # global providers, fetched lazily
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        pytest.skip("a global tracer provider was configured in this process")
    assert not plugin.enabled()
    driver.plugins.unregister(name="zml.otel")
    driver.plugins.register(plugin, name="zml.otel")
    assert driver.infer(policy="prod").routing.node_id == "h100-a"
    assert type(plugin.tracer).__name__ == "ProxyTracer"  # resolves once one is set
    assert OpenTelemetryPlugin(tracer_provider=trace.NoOpTracerProvider()).enabled()


def test_the_api_is_not_imported_until_the_application_uses_it() -> None:
    # A fresh interpreter: this test process imported OpenTelemetry long ago.
    import os
    import subprocess
    import sys

    script = (
        "import sys\n"
        "import zml\n"
        "from zml.plugins.default.otel import OpenTelemetryPlugin, plugin as builtin\n"
        "p = OpenTelemetryPlugin()\n"
        "assert not p.enabled() and p.zml_idle()\n"
        "pm = zml.Client(config=None).plugins\n"
        "assert not pm.wanted('zml_request_started'), 'an idle plugin is called'\n"
        "assert not any(m.startswith('opentelemetry') for m in sys.modules), 'imported'\n"
        "from opentelemetry import trace\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "trace.set_tracer_provider(TracerProvider())\n"
        "p._recheck_at = builtin._recheck_at = 0.0  # the next look, a second later\n"
        "assert p.enabled() and not p.zml_idle()\n"
        "assert pm.wanted('zml_request_started'), 'a configured provider is not called'\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_PYTHON_")}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
