"""Timeouts: ``zml.Timeouts(total, connect, first_token, idle)`` on the client and per call.

* ``first_token`` bounds one attempt until the node starts answering: a stalled node
  (``FaultSpec.stall_s``) trips it, NodeTimeoutError is retryable, so the request fails over.
* ``idle`` bounds the gap between two chunks: after the first token nothing is retried, so a
  stream that goes quiet ends in IncompleteStreamError.
* ``total`` is the request's deadline: expiring in the saturation queue, in an attempt or in the
  middle of a stream, it ends the request with ONE ZMLTimeoutError (and the node sees the
  disconnect).

Assertions are on outcomes and counts; the only clock assertions are lower bounds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import pytest

import zml
from tests.conftest import MODEL
from tests.e2e.conftest import PROD, fleet_fixture, run_client, two_family_nodes, wait_for
from zml.sim import FaultSpec

MSGS = [{"role": "user", "content": "hello"}]
STALL = FaultSpec(stall_s=600.0)  # x time_scale 0.05: 30 s before the first byte
POLICIES = {
    "prod": PROD,
    "h100": {"accelerator_chain": ["H100"]},
    "wait": {"accelerator_chain": ["H100"], "queue_on_saturation": True},
}
ONE_FAMILY = {"h100": POLICIES["h100"]}
SAFETY = 30.0  # an overall deadline so that a regression fails instead of hanging


setup = fleet_fixture(two_family_nodes(), POLICIES, 0.05)


def stream_body(kind: str, **kwargs: Any) -> Callable[[Any], Any]:
    """Stream one request to the end; return (routing, text, chunks seen)."""
    seen: list[Any] = []
    if kind == "sync":
        def sync_body(client: zml.Client) -> Any:
            s = client.infer_stream(MODEL, MSGS, **kwargs)
            for chunk in s:
                seen.append(chunk)
            return s.routing, s.text, seen

        return sync_body

    async def async_body(client: zml.AsyncClient) -> Any:
        s = client.infer_stream(MODEL, MSGS, **kwargs)
        async for chunk in s:
            seen.append(chunk)
        return s.routing, s.text, seen

    return async_body


def infer_body(kind: str, **kwargs: Any) -> Callable[[Any], Any]:
    if kind == "sync":
        def sync_body(client: zml.Client) -> Any:
            return client.infer(MODEL, MSGS, **kwargs)

        return sync_body

    async def async_body(client: zml.AsyncClient) -> Any:
        return await client.infer(MODEL, MSGS, **kwargs)

    return async_body


# --- first token -----------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["client", "call"])
@pytest.mark.parametrize("kind", ["sync", "async"])
def test_stalled_node_trips_first_token_and_fails_over(setup: Any, kind: str,
                                                       where: str) -> None:
    setup.node("h100-a").set_faults(STALL)
    timeouts = zml.Timeouts(total=SAFETY, first_token=0.3)
    if where == "client":
        routing, text, _ = run_client(kind, setup, stream_body(kind, policy="prod"), timeout=timeouts)
    else:
        routing, text, _ = run_client(kind, setup, stream_body(kind, policy="prod", timeout=timeouts))
    assert text and routing.node_id == "mi-a"
    assert [(a.node_id, a.error) for a in routing.attempts] == [("h100-a", "timeout")]
    assert "timed out" in routing.attempts[0].message
    # the stalled attempt was abandoned: the node sees the disconnect
    node = setup.node("h100-a")
    wait_for(lambda: node.stats.aborted_total == 1 and node.stats.running == 0, "the abort")


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_first_token_timeout_applies_even_with_a_long_idle_timeout(setup: Any,
                                                                    kind: str) -> None:
    """first_token=0.3 with the default idle of 60 s: the stall still trips at 0.3 s."""
    setup.node("h100-a").set_faults(STALL)
    timeouts = zml.Timeouts(total=SAFETY, first_token=0.3, idle=60.0)
    routing, _, _ = run_client(kind, setup, stream_body(kind, policy="prod", timeout=timeouts))
    assert routing.node_id == "mi-a"
    assert [a.error for a in routing.attempts] == ["timeout"]


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_long_first_token_timeout_does_not_stretch_the_idle_timeout(sim_fleet: Any,
                                                                      kind: str) -> None:
    """first_token=30 s, idle=0.2 s, a node that sends a chunk every 0.5 s: the gap after the
    first chunk trips idle (no retry after the first token)."""
    nodes = [{"id": "slow", "family": "H100", "max_concurrency": 2,
              "sim": {"ttft_ms": 5.0, "tokens_per_s": 2.0}},
             {"id": "spare", "family": "MI300X", "max_concurrency": 2}]
    setup = sim_fleet(nodes, POLICIES)
    timeouts = zml.Timeouts(total=SAFETY, first_token=30.0, idle=0.2)
    with pytest.raises(zml.IncompleteStreamError) as info:
        run_client(kind, setup, stream_body(kind, policy="prod", timeout=timeouts))
    err = info.value
    assert "idle timeout" in str(err)
    assert err.chunks >= 1 and err.node_id == "slow"
    assert setup.node("slow").stats.requests_total == 1
    assert setup.node("spare").stats.requests_total == 0
    wait_for(lambda: setup.node("slow").stats.aborted_total == 1, "the abort")


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_idle_timeout_with_no_first_token_timeout(sim_fleet: Any, kind: str) -> None:
    nodes = [{"id": "slow", "family": "H100", "max_concurrency": 2,
              "sim": {"ttft_ms": 5.0, "tokens_per_s": 2.0}}]
    setup = sim_fleet(nodes, ONE_FAMILY)
    with pytest.raises(zml.IncompleteStreamError, match="idle timeout"):
        run_client(kind, setup, stream_body(kind, policy="h100"),
            timeout=zml.Timeouts(total=SAFETY, idle=0.2))


# --- the overall deadline ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "async"])
@pytest.mark.parametrize("stream", [False, True], ids=["infer", "stream"])
def test_deadline_expiring_mid_attempt_is_one_timeout_error(setup: Any, kind: str,
                                                            stream: bool) -> None:
    setup.node("h100-a").set_faults(STALL)
    body = (stream_body if stream else infer_body)(kind, policy="h100", timeout=0.4)
    t0 = time.monotonic()
    with pytest.raises(zml.ZMLTimeoutError) as info:
        run_client(kind, setup, body)
    assert time.monotonic() - t0 >= 0.4
    err = info.value
    assert isinstance(err, TimeoutError) and not isinstance(err, zml.NodeError)
    assert "0.4s" in str(err)
    assert err.routing is not None and err.routing.node_id == "h100-a"
    node = setup.node("h100-a")
    assert node.stats.requests_total == 1
    wait_for(lambda: node.stats.aborted_total == 1 and node.stats.running == 0, "the abort")


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_deadline_expiring_mid_attempt_with_failover_left(setup: Any, kind: str) -> None:
    """Both nodes stalled: the deadline ends the request, not attempts_exhausted."""
    for node in ("h100-a", "mi-a"):
        setup.node(node).set_faults(STALL)
    with pytest.raises(zml.ZMLTimeoutError):
        run_client(kind, setup, infer_body(kind, policy="prod", timeout=0.3))
    total = sum(setup.node(n).stats.requests_total for n in ("h100-a", "mi-a"))
    assert total >= 1


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_deadline_expiring_mid_stream_is_one_timeout_error(sim_fleet: Any, kind: str) -> None:
    nodes = [{"id": "gpu", "family": "H100", "max_concurrency": 2,
              "sim": {"ttft_ms": 5.0, "tokens_per_s": 20.0}}]
    setup = sim_fleet(nodes, ONE_FAMILY)
    seen: list[Any] = []

    def sync_body(client: zml.Client) -> None:
        for chunk in client.infer_stream(MODEL, MSGS, policy="h100", max_tokens=400,
                                         extra_body={"ignore_eos": True}, timeout=0.5):
            seen.append(chunk)

    async def async_body(client: zml.AsyncClient) -> None:
        async for chunk in client.infer_stream(MODEL, MSGS, policy="h100", max_tokens=400,
                                               extra_body={"ignore_eos": True}, timeout=0.5):
            seen.append(chunk)

    with pytest.raises(zml.ZMLTimeoutError) as info:
        run_client(kind, setup, sync_body if kind == "sync" else async_body)
    err = info.value
    assert not isinstance(err, zml.NodeError)
    assert "mid-stream" in str(err)
    assert seen, "the stream had started"
    text = "".join(c.choices[0].delta.content or "" for c in seen if c.choices)
    assert err.text.startswith(text) and text
    assert err.routing is not None and err.routing.node_id == "gpu"
    node = setup.node("gpu")
    assert node.stats.requests_total == 1
    wait_for(lambda: node.stats.aborted_total == 1 and node.stats.running == 0, "the abort")


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_a_stream_held_unread_past_its_deadline_frees_its_slot_then(sim_fleet: Any,
                                                                    kind: str) -> None:
    """The caller holds an open stream without reading it: at the deadline the watchdog shuts
    its connection (the node drops the request) and the node slot is free at once, so the next
    request is served by that one-slot node; the held stream raises the deadline's error when
    it is read again. Before, the slot stayed taken until then, and the next request failed
    with a RoutingError against an idle node."""
    nodes = [{"id": "gpu", "family": "H100", "max_concurrency": 1,
              "sim": {"ttft_ms": 5.0, "tokens_per_s": 20.0}}]
    setup = sim_fleet(nodes, ONE_FAMILY)
    long = {"policy": "h100", "max_tokens": 400, "extra_body": {"ignore_eos": True}}

    def sync_body(client: zml.Client) -> None:
        stream = client.infer_stream(MODEL, MSGS, timeout=0.5, **long)
        next(stream)
        wait_for(lambda: client.fleet.in_flight == 0, "the slot freed at the deadline")
        assert client.infer(MODEL, MSGS, policy="h100", max_tokens=2, timeout=SAFETY)
        with pytest.raises(zml.ZMLTimeoutError, match="mid-stream"):
            list(stream)

    async def async_body(client: zml.AsyncClient) -> None:
        stream = client.infer_stream(MODEL, MSGS, timeout=0.5, **long)
        await stream.__anext__()
        for _ in range(int(SAFETY / 0.05)):  # the loop must run for its watchdog to fire
            if client.fleet.in_flight == 0:
                break
            await asyncio.sleep(0.05)
        assert client.fleet.in_flight == 0
        assert await client.infer(MODEL, MSGS, policy="h100", max_tokens=2, timeout=SAFETY)
        with pytest.raises(zml.ZMLTimeoutError, match="mid-stream"):
            async for _ in stream:
                pass

    run_client(kind, setup, sync_body if kind == "sync" else async_body)
    node = setup.node("gpu")
    wait_for(lambda: node.stats.aborted_total == 1 and node.stats.completed_total == 1,
             "one abort, one answer")


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_deadline_expiring_in_the_queue_is_one_timeout_error(setup: Any, kind: str) -> None:
    """No max_queue_ms: the request's deadline bounds its wait (ZMLTimeoutError); with
    max_queue_ms shorter than the deadline it is RoutingError queue_timeout (test_queue.py)."""
    hold = {"max_tokens": 4000, "extra_body": {"ignore_eos": True}}
    # the node has 4 slots: fill them
    if kind == "sync":
        with zml.Client(config=setup.path) as client:
            holders = [client.infer_stream(MODEL, MSGS, policy="h100", **hold) for _ in range(4)]
            with pytest.raises(zml.ZMLTimeoutError):
                client.infer(MODEL, MSGS, policy="wait", timeout=0.3)
            assert client._dispatcher.effects.queues.queued("wait") == []
            for h in holders:
                h.close()
            assert client.fleet.in_flight == 0
        return

    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
            holders = [client.infer_stream(MODEL, MSGS, policy="h100", **hold) for _ in range(4)]
            for h in holders:
                await h.__aenter__()
            results = await asyncio.gather(
                client.infer(MODEL, MSGS, policy="wait", timeout=0.3),
                client.infer(MODEL, MSGS, policy="wait",
                             timeout=zml.Timeouts(total=0.3, first_token=0.1)),
                return_exceptions=True)
            assert all(isinstance(r, zml.ZMLTimeoutError) for r in results), results
            assert client._dispatcher.effects.queues.queued("wait") == []
            for h in holders:
                await h.aclose()
            assert client.fleet.in_flight == 0

    asyncio.run(main())


# --- per-call timeouts override the client's ------------------------------------------------------


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_per_call_timeout_overrides_the_clients(sim_fleet: Any, kind: str) -> None:
    nodes = [{"id": "gpu", "family": "H100", "max_concurrency": 2,
              "sim": {"ttft_ms": 300.0, "tokens_per_s": 100.0}}]
    setup = sim_fleet(nodes, ONE_FAMILY)
    tight = zml.Timeouts(total=0.1)

    if kind == "sync":
        def body(client: zml.Client) -> None:
            with pytest.raises(zml.ZMLTimeoutError):
                client.infer(MODEL, MSGS, policy="h100", max_tokens=3)
            r = client.infer(MODEL, MSGS, policy="h100", max_tokens=3, timeout=SAFETY)
            assert r.choices[0].message.content
            r = client.infer(MODEL, MSGS, policy="h100", max_tokens=3, timeout=None)
            assert r.choices[0].message.content

        run_client(kind, setup, body, timeout=tight)
    else:
        async def abody(client: zml.AsyncClient) -> None:
            with pytest.raises(zml.ZMLTimeoutError):
                await client.infer(MODEL, MSGS, policy="h100", max_tokens=3)
            r = await client.infer(MODEL, MSGS, policy="h100", max_tokens=3, timeout=SAFETY)
            assert r.choices[0].message.content
            r = await client.infer(MODEL, MSGS, policy="h100", max_tokens=3,
                                   timeout=zml.Timeouts(total=None, first_token=SAFETY))
            assert r.choices[0].message.content

        run_client(kind, setup, abody, timeout=tight)


def test_timeouts_value_object() -> None:
    t = zml.Timeouts(total=5, connect=1, first_token=2, idle=3)
    assert (t.total, t.connect, t.first_token, t.idle) == (5, 1, 2, 3)
    assert zml.Timeouts.of(2.5) == zml.Timeouts(total=2.5)
    assert zml.Timeouts.of(None).total is None
    assert zml.Timeouts.of(t) is t
    for bad in (0, -1, True, "10"):
        with pytest.raises(zml.InvalidRequestError):
            zml.Timeouts.of(bad)  # type: ignore[arg-type]
