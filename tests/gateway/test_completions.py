"""``POST /v1/chat/completions`` and the other routes, over real loopback HTTP.

Requests go from httpx2 to the gateway served by uvicorn, and from the gateway's AsyncClient
to simulated nodes: policy selection, routing headers and ``zml_routing``, OpenAI-shaped
errors (400 with param, 401, 403, 502, 503 with the routing context), streams (usage, final
chunk, mid-stream failure), ``/v1/models``, ``/health``, ``/ready`` and ``/metrics``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import zml
from tests.conftest import MODEL

from .conftest import GATEWAY_KEY, NODE_KEY, GatewayServer, _Thread

MSGS = [{"role": "user", "content": "hello"}]
TWO_FAMILIES = {"H100": {"cost_per_hour": 4.0}, "MI300X": {"cost_per_hour": 3.0}}
NODES = [{"id": "h100-1", "family": "H100", "max_concurrency": 4},
         {"id": "mi300x-1", "family": "MI300X", "max_concurrency": 4}]
POLICIES = {"prod": {"accelerator_chain": ["H100", "MI300X"], "cost_priority": "cost"},
            "amd": {"accelerator_chain": ["MI300X"]}}
GATEWAY = f"""[gateway]
default_policy = "prod"
[gateway.aliases]
"chat" = {{ model = "{MODEL}", policy = "amd" }}
"plain" = {{ model = "{MODEL}" }}
"""

Make = Callable[..., GatewayServer]


def sse_events(text: str) -> list[str]:
    """The data of each SSE event of a response body."""
    return [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]


def post(gw: GatewayServer, body: dict[str, Any], **headers: str) -> httpx2.Response:
    return httpx2.post(f"{gw.base_url}/chat/completions", json=body, headers=headers, timeout=30)


@pytest.fixture
def gw(serve_gateway: Make) -> GatewayServer:
    return serve_gateway(NODES, POLICIES, families=TWO_FAMILIES, gateway=GATEWAY)


def test_a_json_completion_carries_routing_headers_and_zml_routing(gw: GatewayServer) -> None:
    r = post(gw, {"model": MODEL, "messages": MSGS, "max_tokens": 5, "seed": 1,
                  "metadata": {"team": "search"}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["message"]["content"]
    assert body["usage"]["completion_tokens"] == 5
    routing = zml.RoutingInfo.model_validate(body["zml_routing"])  # the same shape
    assert routing.node_id == "h100-1" and routing.accelerator == "H100"
    assert routing.policy == "prod"  # the default policy
    assert routing.metadata == {"team": "search"}
    assert r.headers["x-zml-node-id"] == "h100-1"
    assert r.headers["x-zml-accelerator"] == "H100"
    assert r.headers["x-zml-policy"] == "prod"
    assert r.headers["x-zml-queue-depth"] == "0"
    assert r.headers["x-zml-attempts"] == "1"
    assert "routing" not in body


def test_the_policy_comes_from_the_header_then_the_alias_then_the_default(
        gw: GatewayServer) -> None:
    by_header = post(gw, {"model": MODEL, "messages": MSGS, "max_tokens": 2},
                     **{"x-zml-policy": "amd"})
    assert by_header.headers["x-zml-node-id"] == "mi300x-1"
    assert by_header.json()["zml_routing"]["policy"] == "amd"
    by_alias = post(gw, {"model": "chat", "messages": MSGS, "max_tokens": 2})
    assert by_alias.headers["x-zml-policy"] == "amd"
    assert by_alias.json()["model"] == MODEL  # the node saw the real model name
    header_beats_alias = post(gw, {"model": "chat", "messages": MSGS, "max_tokens": 2},
                              **{"x-zml-policy": "prod"})
    assert header_beats_alias.headers["x-zml-node-id"] == "h100-1"
    alias_without_policy = post(gw, {"model": "plain", "messages": MSGS, "max_tokens": 2})
    assert alias_without_policy.headers["x-zml-policy"] == "prod"


def test_without_any_policy_the_request_goes_to_any_healthy_node(serve_gateway: Make) -> None:
    gw = serve_gateway(NODES, POLICIES, families=TWO_FAMILIES)
    r = post(gw, {"model": MODEL, "messages": MSGS, "max_tokens": 2})
    assert r.status_code == 200
    assert "x-zml-policy" not in r.headers
    assert r.json()["zml_routing"]["policy"] is None


def test_an_unknown_policy_or_model_is_a_400_listing_the_known_ones(gw: GatewayServer) -> None:
    r = post(gw, {"model": MODEL, "messages": MSGS}, **{"x-zml-policy": "prdo"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == "unknown_policy"
    assert err["param"] == "x-zml-policy"
    assert "amd, prod" in err["message"] and "did you mean 'prod'" in err["message"]
    r = post(gw, {"model": "gpt-4o", "messages": MSGS})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] == "model" and err["code"] == "model_not_found"
    assert MODEL in err["message"] and "chat, plain" in err["message"]


@pytest.mark.parametrize(("body", "param"), [
    ({"model": MODEL, "messages": "hello"}, "messages"),
    ({"model": MODEL}, "messages"),
    ({"messages": MSGS}, "model"),
    ({"model": MODEL, "messages": MSGS, "stream": "yes"}, "stream"),
    ({"model": MODEL, "messages": MSGS, "metadata": [1]}, "metadata"),
    ({"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
])
def test_an_invalid_request_is_a_400_naming_the_param(gw: GatewayServer, body: dict[str, Any],
                                                      param: str) -> None:
    r = post(gw, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param


def test_a_body_that_is_not_json_or_too_large_is_refused(serve_gateway: Make) -> None:
    gw = serve_gateway(NODES, POLICIES, families=TWO_FAMILIES,
                       gateway="[gateway]\nmax_body_bytes = 2048\n")
    r = httpx2.post(f"{gw.base_url}/chat/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 4000}]}
    r = post(gw, big)
    assert r.status_code == 413 and "max_body_bytes" in r.json()["error"]["message"]


def test_node_parameters_are_passed_through(gw: GatewayServer) -> None:
    """OpenAI parameters and node-specific fields (extra_body in the SDKs) reach the node."""
    r = post(gw, {"model": MODEL, "messages": MSGS, "max_tokens": 7, "ignore_eos": True,
                  "temperature": 0.0})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 7
    r = post(gw, {"model": MODEL, "messages": MSGS, "max_tokens": -3})
    assert r.status_code == 400  # the node's own validation, passed on
    assert r.json()["error"]["type"] == "invalid_request_error"


def test_a_routing_error_is_a_503_with_the_routing_context_and_retry_after(
        serve_gateway: Make) -> None:
    nodes = [{"id": "h100-1", "family": "H100", "max_concurrency": 1,
              "sim": {"faults": {"error_rate": 1.0, "error_status": 503}}},
             {"id": "mi300x-1", "family": "MI300X", "max_concurrency": 1}]
    gw = serve_gateway(nodes, {"nvidia": {"accelerator_chain": ["H100"]}},
                       families=TWO_FAMILIES)
    r = post(gw, {"model": MODEL, "messages": MSGS}, **{"x-zml-policy": "nvidia"})
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["type"] == "routing_error"
    assert err["code"] == err["routing_context"]["final_error"] == "attempts_exhausted"
    ctx = err["routing_context"]
    assert ctx["policy"] == "nvidia"
    assert ctx["evaluated"][0]["family"] == "H100"
    assert ctx["attempts"][0]["node_id"] == "h100-1"
    assert r.headers["retry-after"] == "10"


def test_no_retry_after_when_no_node_can_ever_serve_the_request(serve_gateway: Make) -> None:
    nodes = [{"id": "h100-1", "family": "H100", "max_concurrency": 1, "models": ["other"]},
             {"id": "mi300x-1", "family": "MI300X", "max_concurrency": 1}]
    gw = serve_gateway(nodes, {"nvidia": {"accelerator_chain": ["H100"]}},
                       families=TWO_FAMILIES)
    r = post(gw, {"model": MODEL, "messages": MSGS}, **{"x-zml-policy": "nvidia"})
    assert r.status_code == 503
    ctx = r.json()["error"]["routing_context"]
    assert ctx["evaluated"] == [{"family": "H100", "nodes_checked": 0,
                                 "rejected_reason": "no_nodes_for_model"}]
    assert "retry-after" not in r.headers
    assert r.headers["x-should-retry"] == "false"  # the openai SDKs would retry a 503


def test_a_503_worth_retrying_does_not_say_should_retry_false(serve_gateway: Make) -> None:
    nodes = [{"id": "h100-1", "family": "H100", "max_concurrency": 1,
              "sim": {"faults": {"error_rate": 1.0, "error_status": 503}}}]
    gw = serve_gateway(nodes, {"p": {"accelerator_chain": ["H100"]}})
    r = post(gw, {"model": MODEL, "messages": MSGS}, **{"x-zml-policy": "p"})
    assert r.status_code == 503 and r.headers["retry-after"] == "10"
    assert "x-should-retry" not in r.headers


def test_a_full_fleet_is_a_503_with_retry_after_one_second(serve_gateway: Make) -> None:
    gw = serve_gateway([{"id": "h100-1", "family": "H100", "max_concurrency": 1}],
                       {"p": {"accelerator_chain": ["H100"]}}, time_scale=1.0)
    long = {"model": MODEL, "messages": MSGS, "stream": True, "max_tokens": 2000,
            "ignore_eos": True}
    with httpx2.stream("POST", f"{gw.base_url}/chat/completions", json=long,
                       headers={"x-zml-policy": "p"}, timeout=30) as held:
        assert held.status_code == 200
        r = post(gw, {"model": MODEL, "messages": MSGS}, **{"x-zml-policy": "p"})
    assert r.status_code == 503
    err = r.json()["error"]
    assert err["routing_context"]["evaluated"][0]["rejected_reason"] == \
        "all_nodes_over_capacity"
    assert r.headers["retry-after"] == "1"


def test_a_node_429_on_every_attempt_is_a_429_with_the_nodes_retry_after_rounded_up(
        serve_gateway: Make) -> None:
    nodes = [{"id": "h100-1", "family": "H100", "max_concurrency": 2,
              "sim": {"faults": {"error_rate": 1.0, "error_status": 429, "retry_after_s": 1.3}}}]
    gw = serve_gateway(nodes, {"p": {"accelerator_chain": ["H100"]}})
    for stream in (False, True):
        r = post(gw, {"model": MODEL, "messages": MSGS, "stream": stream},
                 **{"x-zml-policy": "p"})
        assert r.status_code == 429, r.text
        assert r.headers["retry-after"] == "2"  # 1.3 s, rounded up
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and err["code"] == "rate_limited"
        ctx = err["routing_context"]
        assert ctx["final_error"] == "attempts_exhausted" and ctx["policy"] == "p"
        assert {a["error"] for a in ctx["attempts"]} == {"rate_limited"}
    oa = openai.OpenAI(base_url=gw.base_url, api_key="unused", max_retries=0, timeout=30)
    with oa, pytest.raises(openai.RateLimitError):
        oa.chat.completions.create(model=MODEL, messages=MSGS,
                                   extra_headers={"x-zml-policy": "p"})


def test_a_429_and_another_failure_are_a_503_attempts_exhausted(serve_gateway: Make) -> None:
    nodes = [{"id": "h100-1", "family": "H100", "max_concurrency": 2,
              "sim": {"faults": {"error_rate": 1.0, "error_status": 429}}},
             {"id": "mi300x-1", "family": "MI300X", "max_concurrency": 2,
              "sim": {"faults": {"error_rate": 1.0, "error_status": 500}}}]
    gw = serve_gateway(nodes, {"p": {"accelerator_chain": ["H100", "MI300X"]}},
                       families=TWO_FAMILIES)
    r = post(gw, {"model": MODEL, "messages": MSGS}, **{"x-zml-policy": "p"})
    assert r.status_code == 503, r.text
    err = r.json()["error"]
    assert err["code"] == "attempts_exhausted"
    assert {a["error"] for a in err["routing_context"]["attempts"]} >= {"rate_limited"}
    assert r.headers["retry-after"] == "10"


def test_failover_shows_in_the_attempts_header(serve_gateway: Make) -> None:
    nodes = [{"id": "h100-1", "family": "H100", "max_concurrency": 2,
              "sim": {"faults": {"error_rate": 1.0, "error_status": 500}}},
             {"id": "mi300x-1", "family": "MI300X", "max_concurrency": 2}]
    gw = serve_gateway(nodes, POLICIES, families=TWO_FAMILIES, gateway=GATEWAY)
    r = post(gw, {"model": MODEL, "messages": MSGS, "max_tokens": 2})
    assert r.status_code == 200
    assert r.headers["x-zml-attempts"] == "2"
    assert r.headers["x-zml-node-id"] == "mi300x-1"
    attempts = r.json()["zml_routing"]["attempts"]
    assert [a["node_id"] for a in attempts] == ["h100-1"]


def test_a_stream_ends_with_zml_routing_in_its_final_chunk_and_done(gw: GatewayServer) -> None:
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 6, "ignore_eos": True,
            "stream": True}
    with httpx2.stream("POST", f"{gw.base_url}/chat/completions", json=body,
                       timeout=30) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        assert r.headers["x-zml-node-id"] == "h100-1"
        assert r.headers["x-zml-policy"] == "prod"
        text = r.read().decode()
    events = sse_events(text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"]["content"] or "" for c in chunks if c["choices"])
    assert all("zml_routing" not in c for c in chunks[:-1])
    final = chunks[-1]
    assert final["choices"][0]["finish_reason"] == "length"  # no usage chunk: not asked for
    assert all(not c.get("usage") for c in chunks)
    assert zml.RoutingInfo.model_validate(final["zml_routing"]).node_id == "h100-1"


def test_a_stream_with_include_usage_ends_with_the_usage_chunk(gw: GatewayServer) -> None:
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 4, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    r = post(gw, body)
    chunks = [json.loads(e) for e in sse_events(r.text)[:-1]]
    final = chunks[-1]
    assert final["choices"] == []
    assert final["usage"]["completion_tokens"] == 4
    assert final["zml_routing"]["node_id"] == "h100-1"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert "zml_routing" not in chunks[-2]


def test_a_stream_that_breaks_after_its_first_chunk_ends_with_an_error_event(
        serve_gateway: Make) -> None:
    nodes = [{"id": "h100-1", "family": "H100", "max_concurrency": 2,
              "sim": {"faults": {"drop_rate": 1.0}}}]
    gw = serve_gateway(nodes, {"p": {"accelerator_chain": ["H100"]}})
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 50, "ignore_eos": True,
            "stream": True}
    r = post(gw, body, **{"x-zml-policy": "p"})
    assert r.status_code == 200  # the stream had begun
    events = sse_events(r.text)
    assert "[DONE]" not in events
    error = json.loads(events[-1])["error"]
    assert error["type"] == "upstream_error"
    assert error["code"] == "incomplete_stream"
    assert "h100-1" in error["message"]
    assert all("choices" in json.loads(e) for e in events[:-1])


def test_a_stream_that_cannot_start_is_an_ordinary_http_error(serve_gateway: Make) -> None:
    nodes = [{"id": "h100-1", "family": "H100", "max_concurrency": 2,
              "sim": {"faults": {"error_rate": 1.0, "error_status": 500}}}]
    gw = serve_gateway(nodes, {"p": {"accelerator_chain": ["H100"]}})
    r = post(gw, {"model": MODEL, "messages": MSGS, "stream": True}, **{"x-zml-policy": "p"})
    assert r.status_code == 503
    assert r.json()["error"]["type"] == "routing_error"


# --- auth -----------------------------------------------------------------------------------


@pytest.fixture
def keyed_gw(serve_gateway: Make, caplog: pytest.LogCaptureFixture) -> GatewayServer:
    restricted = hashlib.sha256(b"team-b-key").hexdigest()
    caplog.set_level(logging.DEBUG)
    gateway = ("[gateway]\ndefault_policy = \"prod\"\napi_keys_env = \"GW_KEYS\"\n"
               "api_keys_file = \"keys.txt\"\n")
    return serve_gateway(NODES, POLICIES, families=TWO_FAMILIES, node_key=NODE_KEY,
                         gateway=gateway,
                         environ={"GW_KEYS": GATEWAY_KEY, "ZML_API_KEY": NODE_KEY},
                         extra_files={"keys.txt": f"{restricted} amd\n"})


def test_requests_without_a_valid_gateway_key_get_401(keyed_gw: GatewayServer) -> None:
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 2}
    for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": GATEWAY_KEY},
                    {"authorization": f"Bearer {NODE_KEY}"}):
        r = post(keyed_gw, body, **headers)
        assert r.status_code == 401, headers
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key"
        assert r.headers["www-authenticate"] == "Bearer"
    r = httpx2.get(f"{keyed_gw.base_url}/models")
    assert r.status_code == 401
    assert keyed_gw.node("h100-1").stats.requests_total == 0


def test_a_valid_key_is_served_and_never_forwarded_logged_or_echoed(
        keyed_gw: GatewayServer, caplog: pytest.LogCaptureFixture) -> None:
    auth = {"authorization": f"Bearer {GATEWAY_KEY}"}
    r = post(keyed_gw, {"model": MODEL, "messages": MSGS, "max_tokens": 2}, **auth)
    # The node requires NODE_KEY: it answered, so it was sent the node key, not ours.
    assert r.status_code == 200, r.text
    stream = post(keyed_gw, {"model": MODEL, "messages": MSGS, "max_tokens": 2,
                             "stream": True}, **auth)
    bad = post(keyed_gw, {"model": "nope", "messages": MSGS}, **auth)
    models = httpx2.get(f"{keyed_gw.base_url}/models", headers=auth)
    assert models.status_code == 200
    metrics = httpx2.get(f"{keyed_gw.url}/metrics")
    for response in (r, stream, bad, models, metrics):
        assert GATEWAY_KEY not in response.text
        assert NODE_KEY not in response.text
        assert all(GATEWAY_KEY not in v and NODE_KEY not in v
                   for v in response.headers.values())
    assert GATEWAY_KEY not in caplog.text and NODE_KEY not in caplog.text


def test_a_key_limited_to_some_policies_gets_403_for_others(keyed_gw: GatewayServer) -> None:
    auth = {"authorization": "Bearer team-b-key"}
    body = {"model": MODEL, "messages": MSGS, "max_tokens": 2}
    r = post(keyed_gw, body, **auth)  # the default policy, prod: not allowed
    assert r.status_code == 403
    err = r.json()["error"]
    assert err["code"] == "policy_not_allowed" and "allowed policies: amd" in err["message"]
    assert err["param"] == "default_policy" and "[gateway] default_policy" in err["message"]
    r = post(keyed_gw, body, **auth, **{"x-zml-policy": "prod"})
    assert r.status_code == 403 and r.json()["error"]["param"] == "x-zml-policy"
    ok = post(keyed_gw, body, **auth, **{"x-zml-policy": "amd"})
    assert ok.status_code == 200 and ok.headers["x-zml-node-id"] == "mi300x-1"


def test_a_node_rejecting_the_node_key_is_a_502_that_shows_no_key(
        serve_gateway: Make) -> None:
    wrong = "node-key-that-is-wrong-55e1"
    gw = serve_gateway(NODES, POLICIES, families=TWO_FAMILIES, gateway=GATEWAY,
                       node_key=NODE_KEY, environ={"ZML_API_KEY": wrong})
    r = post(gw, {"model": MODEL, "messages": MSGS})
    assert r.status_code == 502
    err = r.json()["error"]
    assert err["code"] == "node_authentication_failed"
    assert "h100-1" in err["message"]
    assert wrong not in r.text and NODE_KEY not in r.text


@pytest.mark.parametrize("where", ["id", "model", "fingerprint"])
def test_a_node_key_the_node_quotes_in_its_answer_is_never_handed_to_the_caller(
        tmp_path: Path, where: str) -> None:
    """A node that puts the key it was sent in a successful answer's id, model or
    system_fingerprint: the gateway's caller (who holds a gateway key, never the node's) gets
    the answer, JSON or streamed, with the key taken out."""
    from tests.e2e.hostile import ECHOED_FIELDS, serving, write_config
    from zml.gateway import create_app

    body = {"model": MODEL, "messages": MSGS}
    with serving() as node:
        config = write_config(tmp_path / "zml.toml", node, {"n-echo": f"echo-key-on={where}"},
                              extra='[gateway]\ndefault_policy = "hostile"\n')
        server = _Thread(create_app(config, environ={"ZML_API_KEY": NODE_KEY},
                                    probe_interval_s=None)).start()
        url = f"http://127.0.0.1:{server.port}/v1/chat/completions"
        try:
            answer = httpx2.post(url, json=body, timeout=30)
            stream = httpx2.post(url, json={**body, "stream": True}, timeout=30)
        finally:
            server.stop()
        sent = node.requests_for(f"echo-key-on={where}")
    assert [r.headers["authorization"] for r in sent] == [f"Bearer {NODE_KEY}"] * 2
    field = ECHOED_FIELDS[where]
    assert answer.status_code == 200, answer.text
    assert answer.json()[field] == f"{field}-[redacted]-end"
    assert stream.status_code == 200
    events = sse_events(stream.text)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks and {c[field] for c in chunks} == {f"{field}-[redacted]-end"}
    for response in (answer, stream):
        assert NODE_KEY not in response.text
        assert not [v for v in response.headers.values() if NODE_KEY in v]


# --- the other routes ---------------------------------------------------------------------


def test_models_lists_served_models_and_aliases(gw: GatewayServer) -> None:
    r = httpx2.get(f"{gw.base_url}/models")
    assert r.status_code == 200
    data = r.json()
    assert data["object"] == "list"
    ids = {m["id"]: m for m in data["data"]}
    assert set(ids) == {MODEL, "chat", "plain"}
    assert ids["chat"]["zml_alias"] == {"model": MODEL, "policy": "amd"}
    assert all(m["object"] == "model" for m in data["data"])


def test_health_and_ready_say_whether_the_process_and_the_fleet_are_up(
        serve_gateway: Make) -> None:
    gw = serve_gateway([{"id": "h100-1", "family": "H100", "max_concurrency": 1}])
    assert httpx2.get(f"{gw.url}/health").json() == {"status": "ok"}
    ready = httpx2.get(f"{gw.url}/ready")
    assert ready.status_code == 200 and ready.json()["ready"] is True
    assert ready.json()["nodes"][0]["up"] is True
    gw.setup.fleet.kill("h100-1")
    gw.gateway._ready = None  # forget the cached answer rather than sleep past it
    down = httpx2.get(f"{gw.url}/ready")
    assert down.status_code == 503 and down.json()["ready"] is False
    assert httpx2.get(f"{gw.url}/health").status_code == 200


@pytest.mark.parametrize(("status", "up"), [(200, True), (204, True), (404, True), (503, False)])
def test_ready_reads_a_nodes_health_as_the_prober_does(tmp_path: Path, status: int,
                                                       up: bool) -> None:
    """Any status below 400 is up, and 404 too (a server without the endpoint): a fleet of
    servers that answer /health with 204, or have none, is ready."""
    from zml.gateway import create_app

    class Health(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    node = ThreadingHTTPServer(("127.0.0.1", 0), Health)
    threading.Thread(target=node.serve_forever, daemon=True).start()
    config = tmp_path / "zml.toml"
    config.write_text(f'[accelerators.H100]\n[[nodes]]\nid = "n"\nfamily = "H100"\n'
                      f'url = "http://127.0.0.1:{node.server_port}"\nmodels = ["{MODEL}"]\n'
                      "max_concurrency = 1\n")
    server = _Thread(create_app(config, environ={}, probe_interval_s=None)).start()
    try:
        ready = httpx2.get(f"http://127.0.0.1:{server.port}/ready", timeout=30)
    finally:
        server.stop()
        node.shutdown()
        node.server_close()
    assert ready.status_code == (200 if up else 503)
    assert ready.json()["nodes"][0]["up"] is up


def test_ready_is_bounded_by_a_node_that_trickles_its_health(tmp_path: Path) -> None:
    """httpx2's timeout bounds each read: a /health body sent a byte every 0.3 s would hold
    /ready for hours. It is bounded in all: that node is down, the healthy one makes it ready."""
    from zml.gateway import create_app

    class Trickle(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-length", "100000")
            self.end_headers()
            try:
                for _ in range(100):
                    self.wfile.write(b"x")
                    self.wfile.flush()
                    time.sleep(0.3)
            except OSError:
                pass

        def log_message(self, *args: Any) -> None:
            pass

    class Ok(Trickle):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("content-length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

    nodes = [ThreadingHTTPServer(("127.0.0.1", 0), handler) for handler in (Trickle, Ok)]
    for node in nodes:
        node.daemon_threads = True
        threading.Thread(target=node.serve_forever, daemon=True).start()
    config = tmp_path / "zml.toml"
    config.write_text("[accelerators.H100]\n" + "".join(
        f'[[nodes]]\nid = "n{i}"\nfamily = "H100"\nurl = "http://127.0.0.1:{node.server_port}"'
        f'\nmodels = ["{MODEL}"]\nmax_concurrency = 1\n' for i, node in enumerate(nodes)))
    server = _Thread(create_app(config, environ={}, probe_interval_s=None)).start()
    try:
        ready = httpx2.get(f"http://127.0.0.1:{server.port}/ready", timeout=20)
    finally:
        server.stop()
        for node in nodes:
            node.shutdown()
            node.server_close()
    assert ready.status_code == 200
    assert {n["id"]: n["up"] for n in ready.json()["nodes"]} == {"n0": False, "n1": True}


def test_unknown_paths_and_methods_get_openai_shaped_errors(gw: GatewayServer) -> None:
    r = httpx2.get(f"{gw.url}/v1/completions")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx2.get(f"{gw.base_url}/chat/completions")
    assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed"
    assert r.headers["allow"] == "POST"  # RFC 9110: a 405 lists the allowed methods
    r = httpx2.delete(f"{gw.base_url}/models")
    assert r.status_code == 405
    assert {m.strip() for m in r.headers["allow"].split(",")} == {"GET", "HEAD"}


def metric_samples(gw: GatewayServer) -> dict[str, list[Any]]:
    text = httpx2.get(f"{gw.url}/metrics").text
    out: dict[str, list[Any]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append(sample)
    return out


def test_metrics_count_requests_by_policy_family_node_and_outcome(gw: GatewayServer) -> None:
    post(gw, {"model": MODEL, "messages": MSGS, "max_tokens": 2})
    post(gw, {"model": "chat", "messages": MSGS, "max_tokens": 2, "stream": True})
    post(gw, {"model": MODEL, "messages": MSGS}, **{"x-zml-policy": "nope"})
    samples = metric_samples(gw)
    counts = {(s.labels["policy"], s.labels["family"], s.labels["node"], s.labels["outcome"]):
              s.value for s in samples["zml_gateway_requests_total"]}
    assert counts[("prod", "H100", "h100-1", "ok")] == 1
    assert counts[("amd", "MI300X", "mi300x-1", "ok")] == 1
    assert counts[("", "", "", "invalid_request")] == 1  # a client's header is no label
    ttft = [s for s in samples["zml_gateway_ttft_seconds_count"]]
    assert [(s.labels["policy"], s.value) for s in ttft] == [("amd", 1)]
    durations = {s.labels["stream"]: s.value
                 for s in samples["zml_gateway_request_duration_seconds_count"]}
    assert durations == {"false": 1, "true": 1}
    assert samples["zml_gateway_requests_in_flight"][0].value == 0
    health = {s.labels["node"]: s.value for s in samples["zml_gateway_node_health"]}
    assert health == {"h100-1": 1.0, "mi300x-1": 1.0}
    assert {s.value for s in samples["zml_gateway_node_circuit_open"]} == {0.0}


def test_two_apps_in_one_process_count_apart(serve_gateway: Make) -> None:
    a = serve_gateway(NODES, POLICIES, families=TWO_FAMILIES, gateway=GATEWAY)
    b = serve_gateway(NODES, POLICIES, families=TWO_FAMILIES, gateway=GATEWAY)
    post(a, {"model": MODEL, "messages": MSGS, "max_tokens": 2})
    assert sum(s.value for s in metric_samples(a)["zml_gateway_requests_total"]) == 1
    assert "zml_gateway_requests_total" not in metric_samples(b)
    assert a.gateway.metrics.registry is not b.gateway.metrics.registry
