"""What the gateway does with requests it cannot serve, over real loopback HTTP: every refusal
is an OpenAI-shaped error, the same for streamed and JSON requests, decided before any node is
called, and counted in the metrics with the outcome it had (never ``ok``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx2
import openai
import pytest

from tests.conftest import MODEL

from .conftest import GatewayServer, raw_exchange
from .test_completions import MSGS, metric_samples, post, sse_events

Make = Callable[..., GatewayServer]
ONE_NODE = [{"id": "h100-1", "family": "H100", "max_concurrency": 4}]
PROD = {"prod": {"accelerator_chain": ["H100"]}}


@pytest.fixture
def gw(serve_gateway: Make) -> GatewayServer:
    return serve_gateway(ONE_NODE, PROD)


def nested(depth: int, leaf: Any = 1) -> Any:
    value = leaf
    for _ in range(depth):
        value = {"k": value}
    return value


def outcomes(gw: GatewayServer) -> dict[str, float]:
    out: dict[str, float] = {}
    for s in metric_samples(gw).get("zml_gateway_requests_total", []):
        out[s.labels["outcome"]] = out.get(s.labels["outcome"], 0) + s.value
    return out


def raw_post(gw: GatewayServer, body: bytes) -> httpx2.Response:
    return httpx2.post(f"{gw.base_url}/chat/completions", content=body,
                       headers={"content-type": "application/json"}, timeout=30)


BAD_FIELDS: list[tuple[dict[str, Any], str]] = [
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "x", "content": "hi"}]}, "messages[0].role"),
    ({"stream_options": 3}, "stream_options"),
    ({"stream_options": "x"}, "stream_options"),
    ({"temperature": float("nan")}, "temperature"),
    ({"max_tokens": float("inf")}, "max_tokens"),
    ({"metadata": {"team": "\ud800"}}, "metadata.team"),
    ({"metadata": nested(300)}, "metadata" + ".k" * 64),
    ({"x": nested(70)}, "x" + ".k" * 63),  # counted from extra_body, where x is sent
]


def test_a_bad_field_is_the_same_400_for_a_stream_as_for_a_json_request_and_no_node_is_called(
        gw: GatewayServer) -> None:
    for fields, param in BAD_FIELDS:
        replies = []
        for stream in (False, True):
            body = {"model": MODEL, "messages": MSGS, "max_tokens": 2, **fields,
                    "stream": stream}
            # Python's json writes NaN, Infinity and lone surrogates as a client could send them.
            r = raw_post(gw, json.dumps(body).encode())
            assert r.status_code == 400, (fields, stream, r.text)
            assert r.headers["content-type"] == "application/json"
            replies.append(r.json()["error"])
        json_error, stream_error = replies
        assert json_error == stream_error, fields
        assert json_error["type"] == "invalid_request_error"
        assert json_error["param"] == param, fields
        assert json_error["message"].startswith(param), fields  # as sent: no extra_body. prefix
        assert "extra_body" not in json_error["message"]
    assert gw.node("h100-1").stats.requests_total == 0
    assert outcomes(gw) == {"invalid_request": 2 * len(BAD_FIELDS)}


@pytest.mark.parametrize(("body", "param", "says"), [
    ({"stream_options": {"include_usage": True}}, "stream_options",
     'applies only to a stream: send "stream": true with it'),
    ({"stream": True, "stream_options": "yes"}, "stream_options",
     'must be an object, e.g. {"include_usage": true}'),
    ({"messages": "hi"}, "messages", 'e.g. [{"role": "user", "content": "Hello"}]'),
])
def test_a_400_speaks_json_to_an_http_caller(gw: GatewayServer, body: dict[str, Any],
                                             param: str, says: str) -> None:
    """The gateway's callers send JSON: no Python syntax, no SDK method names in the advice."""
    r = raw_post(gw, json.dumps({"model": MODEL, "messages": MSGS, **body}).encode())
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and says in error["message"]
    assert "infer" not in error["message"] and "'role'" not in error["message"]


@pytest.mark.parametrize(("body", "says"), [
    (b'{"model": "m", "messages": [], "seed": ' + b"9" * 5000 + b"}",
     "an integer of more than 4300 digits"),
    (b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "\\ud800x": 1}'
     % MODEL.encode(), "a key of the request body is not valid Unicode text"),
])
def test_a_400_names_nothing_the_caller_did_not_send(gw: GatewayServer, body: bytes,
                                                     says: str) -> None:
    r = raw_post(gw, body)
    error = r.json()["error"]
    assert r.status_code == 400 and says in error["message"] and error["param"] is None
    assert "sys." not in error["message"] and "extra_body" not in error["message"]


def test_the_openai_sdk_gets_bad_request_for_a_bad_stream_and_does_not_retry_it(
        gw: GatewayServer) -> None:
    with openai.OpenAI(base_url=gw.base_url, api_key="unused", timeout=30) as oa:  # retries on
        with pytest.raises(openai.BadRequestError) as info:
            for _ in oa.chat.completions.create(
                    model=MODEL, messages=[{"role": "bogus", "content": "hi"}],
                    stream=True):
                pass
        assert "messages[0].role" in str(info.value)
        with pytest.raises(openai.BadRequestError, match="metadata"):
            oa.chat.completions.create(model=MODEL, messages=MSGS,
                                       max_tokens=3, metadata=nested(300, "x"))
    assert gw.node("h100-1").stats.requests_total == 0  # the node never generated
    assert outcomes(gw) == {"invalid_request": 2}  # each sent once: a 400 is not retried


@pytest.mark.parametrize("body", [
    b"[" * 100_000 + b"]" * 100_000,
    json.dumps({"model": MODEL, "messages": MSGS}).encode()[:-1]
    + b',"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # past every Python's json limit
])
def test_a_body_nested_too_deeply_to_parse_is_a_400(gw: GatewayServer, body: bytes) -> None:
    r = raw_post(gw, body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "too deeply" in err["message"]
    assert outcomes(gw) == {"invalid_request": 1}


def test_an_answer_that_cannot_be_written_as_json_is_an_openai_shaped_500(
        gw: GatewayServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A node answering with text that is not valid Unicode (a lone surrogate, escaped)."""
    monkeypatch.setattr("zml.sim.planning.synth_tokens", lambda rng, n: ["\ud800"] * n)
    r = post(gw, {"model": MODEL, "messages": MSGS, "max_tokens": 2})
    assert r.status_code == 500
    assert r.headers["content-type"] == "application/json"
    err = r.json()["error"]
    assert err["type"] == "server_error" and err["code"] == "internal_error"
    counts = {(s.labels["node"], s.labels["outcome"]): s.value
              for s in metric_samples(gw)["zml_gateway_requests_total"]}
    assert counts == {("h100-1", "error"): 1}


def test_a_final_chunk_that_cannot_be_written_ends_the_stream_with_an_error_event(
        gw: GatewayServer, monkeypatch: pytest.MonkeyPatch) -> None:
    def unwritable(routing: object) -> bytes:
        raise ValueError("cannot write zml_routing")

    monkeypatch.setattr("zml.gateway.completions.routing_json", unwritable)
    r = post(gw, {"model": MODEL, "messages": MSGS, "max_tokens": 3, "stream": True})
    assert r.status_code == 200  # the stream had begun
    events = sse_events(r.text)
    assert "[DONE]" not in events
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"  # the held chunk, sent
    error = json.loads(events[-1])["error"]
    assert error["type"] == "server_error" and error["code"] == "internal_error"
    assert outcomes(gw) == {"stream_error": 1}


def test_an_unexpected_failure_is_an_openai_shaped_500_counted_as_an_error(
        gw: GatewayServer, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(routing: object) -> list[tuple[bytes, bytes]]:
        raise RuntimeError("a bug in the gateway")

    monkeypatch.setattr("zml.gateway.completions.routing_headers", broken)
    r = post(gw, {"model": MODEL, "messages": MSGS, "max_tokens": 2})
    assert r.status_code == 500
    assert r.json()["error"]["code"] == "internal_error"
    assert "a bug in the gateway" not in r.text
    s = post(gw, {"model": MODEL, "messages": MSGS, "max_tokens": 2, "stream": True})
    assert s.status_code == 500 and s.json()["error"]["code"] == "internal_error"
    assert r.headers["x-should-retry"] == s.headers["x-should-retry"] == "false"
    assert outcomes(gw) == {"error": 2}
    assert metric_samples(gw)["zml_gateway_requests_in_flight"][0].value == 0


def test_a_body_that_stalls_gets_408_and_the_connection_is_closed(serve_gateway: Make) -> None:
    gw = serve_gateway(ONE_NODE, PROD, gateway="[gateway]\nbody_timeout_s = 0.5\n")
    head, body = raw_exchange(gw, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                              b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                              b'{"model":')  # and no more: the gateway closes the connection
    assert head.startswith(b"HTTP/1.1 408 ")
    assert b"connection: close" in head.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "request_timeout" and "body_timeout_s" in err["message"]
    assert outcomes(gw) == {"invalid_request": 1}
    assert gw.node("h100-1").stats.requests_total == 0


def test_a_body_declared_too_large_gets_413_before_it_is_sent(serve_gateway: Make) -> None:
    """A Content-Length over max_body_bytes is answered at once: the client need not upload
    the body (nor, stalling, wait for the body timeout)."""
    gw = serve_gateway(ONE_NODE, PROD, gateway="[gateway]\nmax_body_bytes = 2048\n"
                                               "body_timeout_s = 5\n")
    head, body = raw_exchange(gw, b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                              b"Connection: close\r\nContent-Type: application/json\r\n"
                              b"Content-Length: 10000000\r\n\r\n" b'{"model":')
    assert head.startswith(b"HTTP/1.1 413 "), head
    assert "max_body_bytes" in json.loads(body)["error"]["message"]
    assert outcomes(gw) == {"invalid_request": 1}


def test_an_unknown_model_or_policy_is_echoed_short_and_gets_no_suggestion_when_huge(
        gw: GatewayServer) -> None:
    r = post(gw, {"model": "prod-model" + "x" * 1_000_000, "messages": MSGS})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and "1000010 characters" in err["message"]
    assert "did you mean" not in err["message"]
    assert len(r.content) < 1000
    r = post(gw, {"model": MODEL, "messages": MSGS}, **{"x-zml-policy": "prod" + "d" * 5000})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "unknown_policy" and "5004 characters" in err["message"]
    assert len(r.content) < 1000
    short = post(gw, {"model": MODEL, "messages": MSGS}, **{"x-zml-policy": "prdo"})
    assert "did you mean 'prod'" in short.json()["error"]["message"]


def test_stream_null_is_the_default_false_as_in_openais_spec(gw: GatewayServer) -> None:
    r = post(gw, {"model": MODEL, "messages": MSGS, "max_tokens": 2, "stream": None})
    assert r.status_code == 200, r.text
    assert r.json()["object"] == "chat.completion"
    bad = post(gw, {"model": MODEL, "messages": MSGS, "stream": "yes"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "stream"


@pytest.mark.parametrize(("body", "fields"), [
    ({"error": {"message": "bad", "param": "messages", "code": "invalid_value"}},
     ("messages", "invalid_value")),
    # vLLM's own shape: the fields at the top, the code a number (not OpenAI's kind of code)
    ({"object": "error", "message": "bad", "type": "BadRequestError", "param": "messages",
      "code": 400}, ("messages", None)),
    ({"error": "bad"}, (None, None)),
    ("bad", (None, None)),
])
def test_a_nodes_400_gives_its_param_and_code_in_either_shape(body: Any,
                                                              fields: tuple[Any, Any]) -> None:
    from zml.gateway.errors import _node_fields

    assert _node_fields(body) == fields
