"""Client behaviour through httpx2.MockTransport: one handler serves the sync and async clients.

Each test runs for both clients (the ``drive`` fixture), since the contract is the same.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx2
import pytest

import zml

CONFIG = """
[accelerators.H100]
cost_per_hour = 4.0
[accelerators.MI300X]

[[nodes]]
id = "h100-a"
family = "H100"
url = "http://h100-a:8000"
models = ["m"]
max_concurrency = 4

[[nodes]]
id = "mi-a"
family = "MI300X"
url = "http://mi-a:8000"
models = ["m"]
max_concurrency = 4

[[nodes]]
id = "mi-b"
family = "MI300X"
url = "http://mi-b:8000"
models = ["m"]
max_concurrency = 4

[policies.prod]
accelerator_chain = ["H100", "MI300X"]
"""

MSGS = [{"role": "user", "content": "Hello"}]
SECRET = "sk-very-secret-123"


def completion(model: str, host: str) -> dict[str, Any]:
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": f"from {host}"},
                     "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


class Fleet:
    """A scripted fleet: per host, a list of responses to give (the last one repeats)."""

    def __init__(self) -> None:
        self.script: dict[str, list[Any]] = {}
        self.calls: list[tuple[str, dict[str, Any], httpx2.Headers]] = []

    def on(self, host: str, *responses: Any) -> None:
        self.script[host] = list(responses)

    def handler(self, request: httpx2.Request) -> httpx2.Response:
        host = request.url.host
        body = json.loads(request.content)
        self.calls.append((host, body, request.headers))
        queue = self.script.get(host, ["ok"])
        action = queue.pop(0) if len(queue) > 1 else queue[0]
        if isinstance(action, BaseException):
            raise action
        if action == "ok":
            return httpx2.Response(200, json=completion(body["model"], host))
        status, headers = action if isinstance(action, tuple) else (action, {})
        return httpx2.Response(status, json={"error": {"message": f"status {status}"}},
                               headers=headers)

    def hosts(self) -> list[str]:
        return [h for h, _, _ in self.calls]


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "zml.toml"
    path.write_text(CONFIG)
    return path


@pytest.fixture
def fleet() -> Fleet:
    return Fleet()


@pytest.fixture(params=["sync", "async"])
def drive(request: pytest.FixtureRequest, config: Path, fleet: Fleet) -> Callable[..., Any]:
    """``drive(**kwargs)`` runs ``infer`` on a fresh client of the parametrised kind."""

    def run(client_kwargs: dict[str, Any] | None = None, **kwargs: Any) -> Any:
        ckw = {"api_key": SECRET, "config": config, **(client_kwargs or {})}
        transport = httpx2.MockTransport(fleet.handler)
        if request.param == "sync":
            with zml.Client(http_client=httpx2.Client(transport=transport), **ckw) as c:
                try:
                    return c.infer(**kwargs)
                finally:
                    assert c.fleet.in_flight == 0

        async def main() -> Any:
            async with zml.AsyncClient(http_client=httpx2.AsyncClient(transport=transport),
                                       **ckw) as c:
                try:
                    return await c.infer(**kwargs)
                finally:
                    assert c.fleet.in_flight == 0

        return asyncio.run(main())

    return run


def test_routing_is_set_and_key_is_sent_as_bearer(drive: Any, fleet: Fleet) -> None:
    r = drive(model="m", messages=MSGS, policy="prod", temperature=0.2, seed=7)
    assert r.choices[0].message.content == "from h100-a"
    assert r.usage.total_tokens == 5
    assert r.routing.node_id == "h100-a" and r.routing.accelerator == "H100"
    assert r.routing.policy == "prod" and r.routing.queue_depth == 0
    assert r.routing.evaluated == [{"family": "H100", "nodes_checked": 1,
                                    "rejected_reason": None}]
    assert r.routing.decision_us > 0 and r.routing.attempts == []
    _host, body, headers = fleet.calls[0]
    assert headers["authorization"] == f"Bearer {SECRET}"
    assert body == {"model": "m", "messages": MSGS, "temperature": 0.2, "seed": 7}


def test_no_policy_behaves_as_0_2(drive: Any, fleet: Fleet) -> None:
    r = drive(model="m", messages=MSGS)
    assert r.routing.policy is None
    assert r.routing.node_id in {"h100-a", "mi-a", "mi-b"}


def test_extra_body_is_merged(drive: Any, fleet: Fleet) -> None:
    drive(model="m", messages=MSGS, extra_body={"top_k": 5})
    assert fleet.calls[0][1]["top_k"] == 5


@pytest.mark.parametrize(
    ("kwargs", "param", "fragment"),
    [
        ({"model": "", "messages": MSGS}, "model", "non-empty model name"),
        ({"model": "m", "messages": "Hello"}, "messages", "must be a list"),
        ({"model": "m", "messages": []}, "messages", "must not be empty"),
        ({"model": "m", "messages": ["Hello"]}, "messages[0]", "mapping"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role",
         "'robot'"),
        ({"model": "m", "messages": [{"role": "user"}]}, "messages[0].content", "no 'content'"),
        ({"model": "m", "messages": [{"role": "user", "content": 3}]}, "messages[0].content",
         "string or a list"),
        ({"model": "m", "messages": MSGS, "temprature": 0.1}, "temprature",
         "did you mean 'temperature'"),
        ({"model": "m", "messages": MSGS, "stream": True}, "stream", "infer_stream"),
        # openai-python's request options are no body fields: say what to do instead
        ({"model": "m", "messages": MSGS, "extra_headers": {"X-A": "1"}}, "extra_headers",
         "http_client=httpx2.Client(headers="),
        ({"model": "m", "messages": MSGS, "extra_query": {"a": "1"}}, "extra_query",
         "no query string"),
        ({"model": "m", "messages": MSGS, "accelerator": "H200"}, "accelerator",
         "did you mean 'H100'"),
        ({"model": "m", "messages": MSGS, "accelerator": "H100", "policy": "prod"},
         "accelerator", "not both"),
        ({"model": "m", "messages": MSGS, "timeout": -1}, "timeout", "positive"),
        ({"model": "m", "messages": MSGS, "metadata": ["team"]}, "metadata", "must be a dict"),
        # extra_body adds fields; it must not replace what zml validated, routed on, or reads
        # the answer by (a streamed answer to infer() would count as the node's fault)
        ({"model": "m", "messages": MSGS, "extra_body": {"stream": True}}, "extra_body.stream",
         "infer_stream"),
        ({"model": "m", "messages": MSGS, "extra_body": {"model": "other"}}, "extra_body.model",
         "model=..."),
        ({"model": "m", "messages": MSGS, "extra_body": {"messages": "hi"}},
         "extra_body.messages", "messages=[...]"),
        # metadata is echoed in routing.metadata (JSON): what JSON cannot carry fails here,
        # before a node does the work, not when the answer is serialised
        ({"model": "m", "messages": MSGS, "metadata": {"team": "x\ud800"}}, "metadata.team",
         "lone surrogate"),
        ({"model": "m", "messages": MSGS, "metadata": {"cost": float("nan")}}, "metadata.cost",
         "finite"),
        ({"model": "m", "messages": MSGS, "metadata": {"when": object()}}, "metadata.when",
         "cannot be sent as JSON"),
    ],
)
def test_bad_arguments_fail_before_sending(
    drive: Any, fleet: Fleet, kwargs: dict[str, Any], param: str, fragment: str
) -> None:
    with pytest.raises(zml.InvalidRequestError) as info:
        drive(**kwargs)
    assert info.value.param == param
    assert fragment in str(info.value)
    assert fleet.calls == []


def test_failover_after_503_is_listed_in_attempts(drive: Any, fleet: Fleet) -> None:
    fleet.on("h100-a", 503)
    r = drive(model="m", messages=MSGS, policy="prod")
    assert r.routing.accelerator == "MI300X"
    assert [(a.node_id, a.error, a.status_code) for a in r.routing.attempts] == [
        ("h100-a", "unavailable", 503)
    ]
    assert r.routing.evaluated[0] == {"family": "H100", "nodes_checked": 1,
                                      "rejected_reason": "excluded_after_failure"}


def test_failover_after_connection_refused(drive: Any, fleet: Fleet) -> None:
    fleet.on("h100-a", httpx2.ConnectError("connection refused"))
    r = drive(model="m", messages=MSGS, policy="prod")
    assert r.routing.accelerator == "MI300X"
    assert r.routing.attempts[0].error == "connection_error"


@pytest.mark.parametrize("status", [400, 401, 403, 404, 422])
def test_client_errors_are_never_retried(drive: Any, fleet: Fleet, status: int) -> None:
    fleet.on("h100-a", status)
    with pytest.raises(zml.NodeStatusError) as info:
        drive(model="m", messages=MSGS, policy="prod")
    assert info.value.status_code == status
    assert info.value.node_id == "h100-a"
    assert info.value.routing is not None and info.value.routing.node_id == "h100-a"
    assert fleet.hosts() == ["h100-a"]


def test_500_everywhere_is_bounded_by_max_attempts(drive: Any, fleet: Fleet) -> None:
    for host in ("h100-a", "mi-a", "mi-b"):
        fleet.on(host, 500)
    with pytest.raises(zml.RoutingError) as info:
        drive({"max_attempts": 2}, model="m", messages=MSGS, policy="prod")
    assert len(fleet.calls) == 2
    ctx = info.value.routing_context
    assert ctx["final_error"] == "attempts_exhausted"
    assert [a["error"] for a in ctx["attempts"]] == ["server_error", "server_error"]
    assert isinstance(info.value.__cause__, zml.InternalServerError)


def test_every_candidate_failing_ends_in_one_routing_error(drive: Any, fleet: Fleet) -> None:
    for host in ("h100-a", "mi-a", "mi-b"):
        fleet.on(host, 502)
    with pytest.raises(zml.RoutingError) as info:
        drive({"max_attempts": 5}, model="m", messages=MSGS, policy="prod")
    assert sorted(fleet.hosts()) == ["h100-a", "mi-a", "mi-b"]
    ctx = info.value.routing_context
    assert ctx["final_error"] == "attempts_exhausted"
    assert {e["rejected_reason"] for e in ctx["evaluated"]} == {"excluded_after_failure"}


def test_429_retry_after_is_honoured_on_the_only_node(drive: Any, fleet: Fleet) -> None:
    fleet.on("h100-a", (429, {"retry-after": "0.05"}), "ok")
    r = drive(model="m", messages=MSGS, accelerator="H100")
    assert fleet.hosts() == ["h100-a", "h100-a"]
    assert r.routing.attempts[0].error == "rate_limited"


def test_api_key_never_appears_in_repr_errors_routing_or_logs(
    drive: Any, fleet: Fleet, config: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    fleet.on("h100-a", 401)
    with pytest.raises(zml.AuthenticationError) as info:
        drive(model="m", messages=MSGS, policy="prod")
    fleet.on("h100-a", "ok")
    r = drive(model="m", messages=MSGS, policy="prod")
    client = zml.Client(api_key=SECRET, config=config)
    texts = [repr(client), str(client), str(info.value), repr(info.value),
             r.routing.model_dump_json(), r.model_dump_json(), caplog.text,
             str(info.value.routing), str(vars(client))]
    for text in texts:
        assert SECRET not in text


def test_api_key_from_environment(config: Path, fleet: Fleet,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ZML_API_KEY", "env-key")
    transport = httpx2.MockTransport(fleet.handler)
    with zml.Client(config=config, http_client=httpx2.Client(transport=transport)) as c:
        c.infer(model="m", messages=MSGS)
    assert fleet.calls[0][2]["authorization"] == "Bearer env-key"


def test_malformed_node_answer_is_a_protocol_error(config: Path) -> None:
    transport = httpx2.MockTransport(lambda r: httpx2.Response(200, text="not json"))
    with zml.Client(config=config, http_client=httpx2.Client(transport=transport)) as c, \
            pytest.raises(zml.NodeProtocolError, match="not JSON"):
        c.infer(model="m", messages=MSGS)
    transport = httpx2.MockTransport(lambda r: httpx2.Response(200, json={"choices": [{}]}))
    with zml.Client(config=config, http_client=httpx2.Client(transport=transport)) as c, \
            pytest.raises(zml.NodeProtocolError, match="malformed"):
        c.infer(model="m", messages=MSGS)
        assert c.fleet.in_flight == 0


def test_retry_after_ms_takes_precedence(drive: Any, fleet: Fleet) -> None:
    fleet.on("h100-a", (429, {"retry-after": "5", "retry-after-ms": "20"}), "ok")
    # With a 2 s deadline, the 5 s hint alone would leave no retry within it: only the 20 ms
    # hint lets the second attempt happen.
    r = drive({"timeout": 2.0}, model="m", messages=MSGS, accelerator="H100")
    assert fleet.hosts() == ["h100-a", "h100-a"]
    assert r.routing.attempts[0].error == "rate_limited"
