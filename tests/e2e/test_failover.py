"""Failover on real loopback sockets: before the first token a failed node is marked and the next
candidate (same family, then the next family) is tried, every failed attempt listed in
``routing.attempts``; after the first token nothing is retried.

Faults come from the simulated node: ``SimFleet.kill`` (connection refused, or connections cut
mid-run), ``FaultSpec(error_rate=1.0, error_status=503)``, 429 with ``Retry-After``,
``drop_rate`` (a stream cut after a few chunks) and ``malformed_rate`` (a bad SSE event).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

import zml
from tests.conftest import MODEL
from tests.e2e.conftest import PROD, fleet_fixture, run_client, settled, two_family_nodes
from zml.sim import FaultSpec

MSGS = [{"role": "user", "content": "hello"}]
POLICIES = {"prod": PROD}
setup = fleet_fixture(two_family_nodes(max_concurrency=8), POLICIES, 0.05)


def infer(kind: str, stream: bool, **kwargs: Any) -> Callable[[Any], Any]:
    """A body that makes one request and returns (routing, text)."""
    if kind == "sync":
        def sync_body(client: zml.Client) -> tuple[Any, str]:
            if stream:
                s = client.infer_stream(MODEL, MSGS, **kwargs)
                assert s.routing is not None  # failover already happened on return
                chunks = list(s)
                assert all(c.routing is s.routing for c in chunks)
                return s.routing, s.text
            r = client.infer(MODEL, MSGS, **kwargs)
            return r.routing, r.choices[0].message.content

        return sync_body

    async def async_body(client: zml.AsyncClient) -> tuple[Any, str]:
        if stream:
            s = client.infer_stream(MODEL, MSGS, **kwargs)
            chunks = [c async for c in s]
            assert all(c.routing is s.routing for c in chunks)
            return s.routing, s.text
        r = await client.infer(MODEL, MSGS, **kwargs)
        return r.routing, r.choices[0].message.content

    return async_body


KINDS = [("sync", False), ("sync", True), ("async", False), ("async", True)]
IDS = ["sync-infer", "sync-stream", "async-infer", "async-stream"]


@pytest.mark.parametrize(("kind", "stream"), KINDS, ids=IDS)
def test_failover_after_connection_refused(setup: Any, kind: str, stream: bool) -> None:
    setup.fleet.kill("h100-a")
    routing, text = run_client(kind, setup, infer(kind, stream, policy="prod"))
    assert text
    assert (routing.node_id, routing.accelerator) == ("mi-a", "MI300X")
    assert [(a.node_id, a.accelerator, a.error, a.status_code) for a in routing.attempts] == [
        ("h100-a", "H100", "connection_error", None)
    ]
    assert routing.evaluated[0] == {"family": "H100", "nodes_checked": 1,
                                    "rejected_reason": "excluded_after_failure"}
    assert settled(setup.node("mi-a")).completed_total == 1


@pytest.mark.parametrize(("kind", "stream"), KINDS, ids=IDS)
def test_failover_after_503(setup: Any, kind: str, stream: bool) -> None:
    setup.node("h100-a").set_faults(FaultSpec(error_rate=1.0, error_status=503))
    routing, text = run_client(kind, setup, infer(kind, stream, policy="prod"))
    assert text and routing.node_id == "mi-a"
    assert [(a.node_id, a.error, a.status_code) for a in routing.attempts] == [
        ("h100-a", "unavailable", 503)
    ]
    assert "503" in routing.attempts[0].message
    assert setup.node("h100-a").stats.rejected_total == 1


@pytest.mark.parametrize(("kind", "stream"), KINDS, ids=IDS)
def test_a_request_the_node_refuses_as_bad_is_not_retried_elsewhere(
        setup: Any, kind: str, stream: bool) -> None:
    # A 400 is the request's fault, not the node's: no other node is asked, none is blamed.
    with pytest.raises(zml.BadRequestError) as info:
        run_client(kind, setup, infer(kind, stream, policy="prod", temperature="hot"))
    assert info.value.status_code == 400
    assert "temperature must be a number" in str(info.value)
    assert info.value.routing is not None and info.value.routing.node_id == "h100-a"
    assert (setup.node("h100-a").stats.rejected_total, setup.node("mi-a").stats.requests_total) \
        == (1, 0)


def test_failover_after_503_configured_in_the_toml(sim_fleet: Any) -> None:
    nodes = [
        {"id": "bad", "family": "H100", "max_concurrency": 4,
         "sim": {"faults": {"error_rate": 1.0, "error_status": 503}}},
        {"id": "good", "family": "MI300X", "max_concurrency": 4},
    ]
    setup = sim_fleet(nodes, POLICIES, time_scale=0.05)
    assert "[nodes.sim.faults]" in setup.path.read_text()
    with zml.Client(config=setup.path) as client:
        r = client.infer(MODEL, MSGS, policy="prod")
        assert r.routing.node_id == "good"
        assert [(a.node_id, a.status_code) for a in r.routing.attempts] == [("bad", 503)]
        assert client.fleet.in_flight == 0
    assert setup.node("bad").stats.rejected_total == 1
    assert settled(setup.node("good")).completed_total == 1


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_every_candidate_failing_is_one_routing_error(setup: Any, kind: str) -> None:
    for node in ("h100-a", "mi-a"):
        setup.node(node).set_faults(FaultSpec(error_rate=1.0, error_status=502))

    def check(err: zml.RoutingError) -> None:
        ctx = err.routing_context
        assert ctx["final_error"] == "attempts_exhausted"
        assert [(a["node_id"], a["error"]) for a in ctx["attempts"]] == [
            ("h100-a", "unavailable"), ("mi-a", "unavailable")]
        assert isinstance(err.__cause__, zml.NodeUnavailableError)

    if kind == "sync":
        with zml.Client(config=setup.path) as client:
            for stream in (False, True):
                with pytest.raises(zml.RoutingError) as info:
                    if stream:
                        client.infer_stream(MODEL, MSGS, policy="prod")
                    else:
                        client.infer(MODEL, MSGS, policy="prod")
                check(info.value)
            assert client.fleet.in_flight == 0
    else:
        async def main() -> None:
            async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
                with pytest.raises(zml.RoutingError) as info:
                    await client.infer(MODEL, MSGS, policy="prod")
                check(info.value)
                with pytest.raises(zml.RoutingError) as info:
                    async for _ in client.infer_stream(MODEL, MSGS, policy="prod"):
                        pass
                check(info.value)
                assert client.fleet.in_flight == 0

        asyncio.run(main())
    assert setup.node("h100-a").stats.requests_total == 2
    assert setup.node("mi-a").stats.requests_total == 2


def test_node_killed_mid_run(sim_fleet: Any) -> None:
    """Requests keep flowing while a node is killed: those in flight on it (before their first
    token) and those sent after fail over; nothing is lost."""
    nodes = [
        {"id": "h100-a", "family": "H100", "max_concurrency": 4},
        {"id": "h100-b", "family": "H100", "max_concurrency": 4},
        {"id": "mi-a", "family": "MI300X", "max_concurrency": 8},
    ]
    setup = sim_fleet(nodes, POLICIES, time_scale=0.2)
    total = 60

    async def main() -> list[Any]:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
            gate = asyncio.Semaphore(8)
            done = 0
            killed = asyncio.Event()

            async def one(i: int) -> Any:
                nonlocal done
                async with gate:
                    r = await client.infer(MODEL, [{"role": "user", "content": f"q{i}"}],
                                           policy="prod", max_tokens=20,
                                           extra_body={"ignore_eos": True})
                done += 1
                if done == total // 3:
                    await asyncio.to_thread(setup.fleet.kill, "h100-a")
                    killed.set()
                return r

            results = await asyncio.gather(*(one(i) for i in range(total)))
            assert killed.is_set()
            assert client.fleet.in_flight == 0
            return list(results)

    results = asyncio.run(main())
    assert len(results) == total and all(isinstance(r, zml.ChatCompletion) for r in results)
    failed_on_a = [a for r in results for a in r.routing.attempts]
    assert failed_on_a, "no request met the killed node"
    assert {(a.node_id, a.error) for a in failed_on_a} == {("h100-a", "connection_error")}
    served = {n: sum(r.routing.node_id == n for r in results) for n in ("h100-a", "h100-b", "mi-a")}
    assert served["h100-a"] >= 1 and served["h100-b"] >= 1
    assert sum(served.values()) == total
    # none was lost, and the surviving nodes did each request once; the killed node may have
    # finished an answer that the kill then cut off (the client saw no token and failed over)
    assert settled(setup.node("h100-b")).completed_total == served["h100-b"]
    assert settled(setup.node("mi-a")).completed_total == served["mi-a"]
    extra = settled(setup.node("h100-a")).completed_total - served["h100-a"]
    assert 0 <= extra <= len(failed_on_a)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_429_retry_after_is_honoured_on_the_only_candidate(sim_fleet: Any, kind: str) -> None:
    nodes = [{"id": "only", "family": "H100", "max_concurrency": 4}]
    setup = sim_fleet(nodes, {"h": {"accelerator_chain": ["H100"]}}, time_scale=0.05)
    node = setup.node("only")
    node.set_faults(FaultSpec(error_rate=1.0, error_status=429, retry_after_s=1.0))

    def lift_after_first_rejection() -> None:
        deadline = time.monotonic() + 20
        while node.stats.rejected_total < 1 and time.monotonic() < deadline:
            time.sleep(0.002)
        node.set_faults(FaultSpec())

    lifter = threading.Thread(target=lift_after_first_rejection)
    lifter.start()
    t0 = time.monotonic()
    routing, text = run_client(kind, setup, infer(kind, False, policy="h"))
    waited = time.monotonic() - t0
    lifter.join()
    assert text and routing.node_id == "only"
    assert [(a.node_id, a.error, a.status_code) for a in routing.attempts] == [
        ("only", "rate_limited", 429)]
    assert waited >= 1.0  # the Retry-After (a lower bound: never flaky)
    assert (node.stats.requests_total, node.stats.rejected_total) == (2, 1)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_429_fails_over_at_once_and_leaves_health_alone(setup: Any, kind: str) -> None:
    setup.node("h100-a").set_faults(FaultSpec(error_rate=1.0, error_status=429,
                                              retry_after_s=30.0))

    def body_sync(client: zml.Client) -> tuple[Any, float]:
        r = client.infer(MODEL, MSGS, policy="prod")
        return r.routing, client.fleet.node("h100-a").health

    async def body_async(client: zml.AsyncClient) -> tuple[Any, float]:
        r = await client.infer(MODEL, MSGS, policy="prod")
        return r.routing, client.fleet.node("h100-a").health

    routing, health = run_client(kind, setup, body_sync if kind == "sync" else body_async)
    assert routing.node_id == "mi-a"
    assert [(a.node_id, a.error) for a in routing.attempts] == [("h100-a", "rate_limited")]
    assert health == 1.0  # rate limiting is load, not ill health


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_dropped_connection_before_any_token_fails_over(setup: Any, kind: str) -> None:
    """A non-streamed answer cut before its body reached the caller is retried elsewhere;
    a stream cut after its first chunk is not (next test)."""
    setup.node("h100-a").set_faults(FaultSpec(drop_rate=1.0))
    routing, text = run_client(kind, setup, infer(kind, False, policy="prod"))
    assert text and routing.node_id == "mi-a"
    assert [(a.node_id, a.error) for a in routing.attempts] == [("h100-a", "connection_error")]
    assert settled(setup.node("h100-a")).dropped_total == 1


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_no_retry_after_the_first_token(setup: Any, kind: str) -> None:
    """drop_rate=1.0: the node cuts the stream after a few chunks. One dispatch, one
    IncompleteStreamError with what was received; the healthy MI300X node is never asked."""
    setup.node("h100-a").set_faults(FaultSpec(drop_rate=1.0))
    received: list[Any] = []

    def body_sync(client: zml.Client) -> None:
        for chunk in client.infer_stream(MODEL, MSGS, policy="prod"):
            received.append(chunk)

    async def body_async(client: zml.AsyncClient) -> None:
        async for chunk in client.infer_stream(MODEL, MSGS, policy="prod"):
            received.append(chunk)

    with pytest.raises(zml.IncompleteStreamError) as info:
        run_client(kind, setup, body_sync if kind == "sync" else body_async)
    err = info.value
    assert err.chunks == len(received) >= 2
    text = "".join(c.choices[0].delta.content or "" for c in received if c.choices)
    assert err.text == text and text
    assert err.node_id == "h100-a"
    assert err.routing is not None and err.routing.node_id == "h100-a"
    assert err.routing.attempts == []
    assert not err.retryable
    assert setup.node("h100-a").stats.requests_total == 1  # ONE dispatch
    assert settled(setup.node("h100-a")).dropped_total == 1
    assert setup.node("mi-a").stats.requests_total == 0


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_malformed_event_is_a_protocol_error(setup: Any, kind: str) -> None:
    setup.node("h100-a").set_faults(FaultSpec(malformed_rate=1.0))

    def body_sync(client: zml.Client) -> None:
        for _ in client.infer_stream(MODEL, MSGS, policy="prod"):
            pass

    async def body_async(client: zml.AsyncClient) -> None:
        async for _ in client.infer_stream(MODEL, MSGS, policy="prod"):
            pass

    with pytest.raises(zml.NodeProtocolError) as info:
        run_client(kind, setup, body_sync if kind == "sync" else body_async)
    err = info.value
    assert not isinstance(err, zml.IncompleteStreamError)
    assert "malformed" in str(err) and err.node_id == "h100-a"
    assert err.routing is not None and err.routing.node_id == "h100-a"
    assert setup.node("h100-a").stats.requests_total == 1
    assert setup.node("mi-a").stats.requests_total == 0
