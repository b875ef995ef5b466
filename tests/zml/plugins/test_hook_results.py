"""What hooks and telemetry are given, and what zml does with what plugins give back.

The counts hooks receive are the caller's (checked), a span counts every attempt sent, a
plugin's wrong answer (a cost that is not one, a ledger that is not one or that raises, a
framing header) is logged and set aside, never a failed request nor a silent loss.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx2
import pytest

import zml

from .conftest import CONFIG, Driver, Nodes, Recorder, completion
from .test_otel import only_span, points


def sse_body(*chunks: dict[str, Any], done: bool = True) -> httpx2.Response:
    events = [json.dumps({"id": "c1", "object": "chat.completion.chunk", "created": 1,
                          "model": "m", **c}) for c in chunks]
    text = "".join(f"data: {e}\n\n" for e in [*events, *(["[DONE]"] if done else [])])
    return httpx2.Response(200, content=text.encode(),
                           headers={"content-type": "text/event-stream"})


def two_choices(body: dict[str, Any]) -> httpx2.Response:
    if body.get("stream"):
        return sse_body(
            {"choices": [{"index": 1, "delta": {"content": "b"}, "finish_reason": "length"}]},
            {"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": "stop"}]},
        )
    answer = completion("m", "h100-a")
    answer["choices"] = [
        {"index": 1, "message": {"role": "assistant", "content": "b"}, "finish_reason": "length"},
        {"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop"},
    ]
    return httpx2.Response(200, json=answer)


def test_a_stream_cut_after_its_first_token_counts_its_attempt(
        traced: SimpleNamespace, nodes: Nodes) -> None:
    nodes.status["h100-a"] = 503  # one failover, then a stream that breaks
    nodes.answer["mi-a"] = lambda body: sse_body(
        {"choices": [{"index": 0, "delta": {"content": "he"}}]}, done=False)
    with pytest.raises(zml.IncompleteStreamError):
        traced.driver.stream(policy="prod")
    span = only_span(traced)
    assert span.attributes["zml.attempts"] == 2  # h100-a's 503 and mi-a's broken stream
    assert span.attributes["error.type"] == "IncompleteStreamError"


def test_every_choice_has_its_finish_reason_on_the_span(
        traced: SimpleNamespace, nodes: Nodes) -> None:
    nodes.answer["h100-a"] = two_choices
    traced.driver.infer(policy="h100only", n=2)
    traced.driver.stream(policy="h100only", n=2)
    spans = traced.exporter.get_finished_spans()
    assert [s.attributes["gen_ai.response.finish_reasons"] for s in spans] == [
        ("stop", "length"), ("stop", "length")]  # in index order, both paths


def test_hooks_get_the_usage_the_caller_sees(driver: Driver, nodes: Nodes) -> None:
    recorder = Recorder()
    driver.plugins.register(recorder, name="recorder")
    r = driver.infer(policy="h100only")
    (_, completed), = [e for e in recorder.events if e[0] == "completed"]
    assert r.usage is not None and completed["usage"] == r.usage.model_dump()
    assert completed["usage"]["total_tokens"] == 8


@pytest.mark.parametrize("bad", ["3", True, -1, 2.5])
def test_a_usage_count_that_is_not_a_count_is_a_protocol_error_in_both_paths(
        driver: Driver, nodes: Nodes, bad: object) -> None:
    usage = {"prompt_tokens": bad, "completion_tokens": 5, "total_tokens": 8}

    def answer(body: dict[str, Any]) -> httpx2.Response:
        if body.get("stream"):
            return sse_body({"choices": [{"index": 0, "delta": {"content": "a"},
                                          "finish_reason": "stop"}]},
                            {"choices": [], "usage": usage})
        return httpx2.Response(200, json={**completion("m", "h100-a"), "usage": usage})

    nodes.answer["h100-a"] = answer
    with pytest.raises(zml.NodeProtocolError, match="prompt_tokens"):
        driver.infer(policy="h100only")
    with pytest.raises(zml.NodeProtocolError, match="prompt_tokens"):
        driver.stream(policy="h100only")


def test_server_port_is_the_schemes_when_the_url_names_none(
        tmp_path: Path, make_driver: Any, otel: SimpleNamespace) -> None:
    from .conftest import use_otel

    path = tmp_path / "ports.toml"
    path.write_text(CONFIG.replace("http://h100-a:8000", "https://h100-a")
                    .replace("http://mi-a:8001", "http://mi-a"))
    driver = make_driver(path)
    use_otel(driver, otel)
    assert driver.infer(policy="h100only").routing.server_address == "h100-a:443"
    assert driver.client.fleet.node("mi-a").address == "mi-a:80"
    spans = otel.exporter.get_finished_spans()
    assert {(s.attributes["server.address"], s.attributes["server.port"]) for s in spans} \
        == {("h100-a", 443)}
    (duration,) = points(otel.reader, "gen_ai.client.operation.duration")
    assert duration.attributes["server.port"] == 443


class BadCost:
    def __init__(self, answer: object) -> None:
        self.answer = answer

    @zml.hookimpl
    def zml_attribute_cost(self) -> object:
        return self.answer


@pytest.mark.parametrize("answer", [{"amount": "12 USD", "basis": "flat"}, {"amount": 0.25},
                                    0.0042, "free"])
def test_a_cost_that_is_not_one_is_logged_and_the_default_model_decides(
        driver: Driver, caplog: pytest.LogCaptureFixture, answer: object) -> None:
    driver.plugins.register(BadCost(answer), name="bad-cost")
    with caplog.at_level(logging.WARNING, logger="zml.plugins"):
        r = driver.infer(policy="h100only")
    assert r.routing.cost is not None and r.routing.cost.basis == "node_seconds"
    (record,) = [r for r in caplog.records if r.name == "zml.plugins"]
    assert "'bad-cost'" in record.getMessage() and "zml_attribute_cost" in record.getMessage()


class FramingHeaders:
    @zml.hookimpl
    def zml_request_headers(self, headers: dict[str, str]) -> None:
        headers["Content-Length"] = "1"
        headers["Transfer-Encoding"] = "chunked"
        headers["x-team"] = "search"


def test_a_plugins_framing_header_is_not_sent_and_the_request_goes_on(
        driver: Driver, nodes: Nodes, caplog: pytest.LogCaptureFixture) -> None:
    driver.plugins.register(FramingHeaders(), name="framing")
    with caplog.at_level(logging.WARNING, logger="zml.plugins"):
        assert driver.infer(policy="h100only").routing.node_id == "h100-a"
    (sent,) = nodes.headers
    assert sent["x-team"] == "search" and "transfer-encoding" not in sent
    assert sent["content-length"] != "1"
    message = caplog.text  # (the reason is the logged exception's)
    assert "'Content-Length'" in message and "'Transfer-Encoding'" in message


class Ledger:
    """A ledger whose methods raise as asked."""

    def __init__(self, fail: str) -> None:
        self.fail = fail
        self.calls: list[str] = []

    def acquire(self, node: Any, lease_id: str) -> bool:
        self.calls.append("acquire")
        if self.fail == "acquire":
            raise OSError("ledger store unreachable")
        return True

    async def aacquire(self, node: Any, lease_id: str) -> bool:
        return self.acquire(node, lease_id)

    def release(self, node: Any, lease_id: str) -> None:
        self.calls.append("release")
        if self.fail == "release":
            raise RuntimeError("release failed")


class LedgerPlugin:
    def __init__(self, ledger: object) -> None:
        self.ledger = ledger

    @zml.hookimpl
    def zml_slot_ledger(self) -> object:
        return self.ledger


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("fail", ["acquire", "release"])
def test_a_ledger_that_raises_does_not_fail_the_request(
        config: Path, nodes: Nodes, kind: str, fail: str,
        caplog: pytest.LogCaptureFixture) -> None:
    ledger = Ledger(fail)
    zml.plugins.register(LedgerPlugin(ledger), name="raising-ledger")
    try:
        driver = Driver(kind, config, nodes)
    finally:
        zml.plugins.unregister(name="raising-ledger")
    try:
        assert driver.client.fleet.ledger is ledger
        with caplog.at_level(logging.WARNING, logger="zml.plugins"):
            for _ in range(3):
                assert driver.infer(policy="h100only").routing.node_id == "h100-a"
        assert driver.client.fleet.node("h100-a").load == 0  # every local slot came back
        warnings = [r for r in caplog.records
                    if r.name == "zml.plugins" and r.levelno == logging.WARNING]
        assert len(warnings) == 1 and "Ledger" in warnings[0].getMessage()
        # a failed acquire keeps no lease (so none is given back); a failed release is tried
        # once per request
        assert ledger.calls == (["acquire"] * 3 if fail == "acquire"
                                else ["acquire", "release"] * 3)
    finally:
        driver.close()


def test_a_ledger_plugin_returning_something_else_fails_the_build(config: Path) -> None:
    zml.plugins.register(LedgerPlugin({"acquire": True}), name="dict-ledger")
    try:
        with pytest.raises(zml.PolicyConfigError,
                           match=r"plugin 'dict-ledger' returned a dict .*not a "
                                 r"zml\.ledger\.SlotLedger"):
            zml.Client(config=config)
    finally:
        zml.plugins.unregister(name="dict-ledger")


class RaisingLedgerPlugin:
    @zml.hookimpl(tryfirst=True)
    def zml_slot_ledger(self) -> object:
        raise RuntimeError("store misconfigured")


def test_a_ledger_plugin_that_raises_leaves_another_plugin_s_ledger_in_use(
        config: Path, caplog: pytest.LogCaptureFixture) -> None:
    """It was one pluggy call: the first exception ended it, and the client kept local
    counts only, although another plugin had a working ledger (replicas then oversubscribe)."""
    ledger = Ledger("never")
    zml.plugins.register(LedgerPlugin(ledger), name="good-ledger")
    zml.plugins.register(RaisingLedgerPlugin(), name="broken-ledger")  # asked first
    try:
        with caplog.at_level(logging.WARNING, logger="zml.plugins"):
            client = zml.Client(config=config)
    finally:
        zml.plugins.unregister(name="broken-ledger")
        zml.plugins.unregister(name="good-ledger")
    try:
        assert client.fleet.ledger is ledger
        warned = [r.getMessage() for r in caplog.records if r.name == "zml.plugins"]
        assert len(warned) == 1 and "'broken-ledger'" in warned[0]
    finally:
        client.close()


@pytest.mark.parametrize(("stop_after", "ending"), [(1, "cancelled"), (2, "completed")])
def test_a_stream_left_once_its_answer_is_whole_completed(
        driver: Driver, stop_after: int, ending: str) -> None:
    """The usual SSE here: two content chunks (the second with finish_reason "stop"), a usage
    chunk, [DONE], all in one read. Leaving after the finish_reason, as chat UIs do, is no
    cancellation: the request's usage (decoded with the rest) and cost are recorded."""
    recorder = Recorder()
    driver.plugins.register(recorder, name="recorder")
    stream, chunks = driver.stream(policy="h100only", stop_after=stop_after)
    assert len(chunks) == stop_after
    assert recorder.names() == ["started", "routed", ending]
    if ending == "completed":
        (_, completed), = [e for e in recorder.events if e[0] == "completed"]
        assert completed["cost"] is not None and completed["usage"] == {
            "prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
        assert stream.routing is not None and stream.routing.cost is not None
    assert driver.client.fleet.node("h100-a").load == 0
