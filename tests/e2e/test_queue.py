"""``queue_on_saturation``: when every node is busy, a request waits in the client-side queue of
its policy (FIFO) until capacity frees, or until ``max_queue_ms`` (RoutingError
``queue_timeout``); cancelling a queued request removes it from the queue.

Capacity is held by a long stream kept open after its first chunk: deterministic, no timing.
"""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

import zml
from tests.conftest import MODEL
from tests.e2e.conftest import await_for, collect, fleet_fixture, settled, wait_for

MSGS = [{"role": "user", "content": "hi"}]
HOLD = {"max_tokens": 4000, "extra_body": {"ignore_eos": True}}
NODES = [{"id": "solo", "family": "H100", "max_concurrency": 1}]
POLICIES = {
    "wait": {"accelerator_chain": ["H100"], "queue_on_saturation": True, "max_queue_ms": 20000},
    "brief": {"accelerator_chain": ["H100"], "queue_on_saturation": True, "max_queue_ms": 150},
    "nowait": {"accelerator_chain": ["H100"]},
}


setup = fleet_fixture(NODES, POLICIES, 0.1)


def queue_of(client: Any, policy: str) -> list[Any]:
    """The saturation-queue tickets of ``policy``, oldest first."""
    return client._dispatcher.effects.queues.queued(policy)


# --- waiting, then success ------------------------------------------------------------------


def test_sync_request_waits_for_capacity_then_succeeds(setup: Any) -> None:
    with zml.Client(config=setup.path) as client:
        holder = client.infer_stream(MODEL, MSGS, policy="wait", **HOLD)
        it = iter(holder)  # keep the iterator: dropping it closes the stream
        next(it)
        with pytest.raises(zml.RoutingError) as info:  # without queueing: at once
            client.infer(MODEL, MSGS, policy="nowait")
        assert info.value.routing_context["final_error"] == "no_viable_node"
        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(client.infer, MODEL, MSGS, policy="wait", max_tokens=5)
            wait_for(lambda: len(queue_of(client, "wait")) == 1, "the request to queue")
            assert not future.done()
            assert setup.node("solo").stats.requests_total == 1  # nothing sent while queued
            holder.close()
            r = future.result(timeout=30)
        assert r.routing.node_id == "solo" and r.routing.policy == "wait"
        assert r.routing.queued_ms > 0
        assert queue_of(client, "wait") == []
        assert client.fleet.in_flight == 0


def test_async_request_waits_for_capacity_then_succeeds(setup: Any) -> None:
    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
            holder = client.infer_stream(MODEL, MSGS, policy="wait", **HOLD)
            it = holder.__aiter__()
            await it.__anext__()
            waiting = asyncio.create_task(
                client.infer(MODEL, MSGS, policy="wait", max_tokens=5))
            streamed = client.infer_stream(MODEL, MSGS, policy="wait", max_tokens=5)
            stream_task = asyncio.create_task(collect(streamed))
            await await_for(lambda: len(queue_of(client, "wait")) == 2, "two queued requests")
            assert not waiting.done() and not stream_task.done()
            await holder.aclose()
            await it.aclose()
            r = await waiting
            chunks = await stream_task
            assert r.routing.queued_ms > 0 and r.routing.node_id == "solo"
            assert chunks[0].routing.queued_ms > 0
            assert chunks[0].routing.queued_ms > r.routing.queued_ms  # it waited behind
            assert queue_of(client, "wait") == []
            assert client.fleet.in_flight == 0

    asyncio.run(main())
    stats = settled(setup.node("solo"))
    assert (stats.requests_total, stats.completed_total, stats.aborted_total) == (3, 2, 1)


# --- queue_timeout ---------------------------------------------------------------------------


def check_queue_timeout(err: zml.RoutingError) -> None:
    ctx = err.routing_context
    assert ctx["final_error"] == "queue_timeout"
    assert ctx["policy"] == "brief"
    assert ctx["evaluated"] == [
        {"family": "H100", "nodes_checked": 1, "rejected_reason": "all_nodes_over_capacity"}
    ]
    assert "max_queue_ms" in ctx["recommendation"]
    assert "queue_timeout" in str(err)


def test_sync_queue_timeout(setup: Any) -> None:
    with zml.Client(config=setup.path) as client:
        with client.infer_stream(MODEL, MSGS, policy="wait", **HOLD) as holder:
            it = iter(holder)  # keep the iterator: dropping it closes the stream
            next(it)
            t0 = time.monotonic()
            with pytest.raises(zml.RoutingError) as info:
                client.infer(MODEL, MSGS, policy="brief")
            assert time.monotonic() - t0 >= 0.15  # it did wait max_queue_ms (a lower bound)
            check_queue_timeout(info.value)
            with pytest.raises(zml.RoutingError) as info:
                client.infer_stream(MODEL, MSGS, policy="brief")
            check_queue_timeout(info.value)
            assert queue_of(client, "brief") == []
        assert client.fleet.in_flight == 0
    assert setup.node("solo").stats.requests_total == 1


def test_async_queue_timeout(setup: Any) -> None:
    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
            async with client.infer_stream(MODEL, MSGS, policy="wait", **HOLD) as holder:
                it = holder.__aiter__()
                await it.__anext__()
                results = await asyncio.gather(
                    client.infer(MODEL, MSGS, policy="brief"),
                    collect(client.infer_stream(MODEL, MSGS, policy="brief")),
                    return_exceptions=True,
                )
                for err in results:
                    assert isinstance(err, zml.RoutingError), err
                    check_queue_timeout(err)
                assert queue_of(client, "brief") == []
                await it.aclose()
            assert client.fleet.in_flight == 0

    asyncio.run(main())
    assert setup.node("solo").stats.requests_total == 1


# --- FIFO ------------------------------------------------------------------------------------


def test_queued_requests_are_served_in_fifo_order(setup: Any) -> None:
    async def main() -> list[str]:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
            holder = client.infer_stream(MODEL, MSGS, policy="wait", **HOLD)
            it = holder.__aiter__()
            await it.__anext__()
            order: list[str] = []

            async def one(name: str) -> None:
                r = await client.infer(MODEL, [{"role": "user", "content": name}],
                                       policy="wait", max_tokens=3)
                assert r.routing.queued_ms > 0
                order.append(name)

            names = [f"r{i}" for i in range(6)]
            tasks = []
            for i, name in enumerate(names):  # enqueue one after the other: a known order
                tasks.append(asyncio.create_task(one(name)))
                await await_for(lambda n=i + 1: len(queue_of(client, "wait")) == n,
                                f"{name} to be queued")
            await it.aclose()
            await asyncio.gather(*tasks)
            assert client.fleet.in_flight == 0 and queue_of(client, "wait") == []
            return order

    order = asyncio.run(main())
    assert order == [f"r{i}" for i in range(6)]
    assert setup.node("solo").stats.running_peak == 1


def test_sync_threads_are_served_in_fifo_order(setup: Any) -> None:
    with zml.Client(config=setup.path) as client:
        holder = client.infer_stream(MODEL, MSGS, policy="wait", **HOLD)
        it = iter(holder)  # keep the iterator: dropping it closes the stream
        next(it)
        order: list[str] = []
        lock = threading.Lock()

        def one(name: str) -> None:
            client.infer(MODEL, [{"role": "user", "content": name}], policy="wait", max_tokens=3)
            with lock:
                order.append(name)

        with ThreadPoolExecutor(4) as pool:
            futures = []
            for i in range(4):
                futures.append(pool.submit(one, f"t{i}"))
                wait_for(lambda n=i + 1: len(queue_of(client, "wait")) == n, "queueing")
            holder.close()
            for f in futures:
                f.result(timeout=30)
        assert order == ["t0", "t1", "t2", "t3"]
        assert client.fleet.in_flight == 0


def test_a_newcomer_does_not_overtake_queued_requests(setup: Any) -> None:
    """Capacity frees while requests are queued: a request arriving at that moment must not
    take the slot ahead of them (driven through the flow by hand: no timing)."""
    from zml.dispatch import ResponseSummary, Send, Wait

    client = zml.Client(config=setup.path)
    d = client._dispatcher
    policy = client.policy("wait")

    def call() -> Any:
        c = d.start(model=MODEL, messages=MSGS, policy=policy, accelerator=None, params={},
                    stream=False, metadata=None, timeouts=d.timeouts)
        return c, c.flow()

    def step(c: Any) -> Any:
        return c[0].advance(c[1], None)[0]

    done = ResponseSummary(None, None, "stop")
    holder, first, newcomer = call(), call(), call()
    sent = step(holder)
    assert isinstance(sent, Send)
    assert isinstance(step(first), Wait) and queue_of(client, "wait") == [first[0].record.ticket]
    holder[0].succeeded(sent.step, None, done)  # the slot frees; `first` has not woken yet
    got = step(newcomer)
    assert isinstance(got, Wait), "the newcomer took the slot ahead of a queued request"
    assert queue_of(client, "wait") == [first[0].record.ticket, newcomer[0].record.ticket]
    sent = step(first)
    assert isinstance(sent, Send)
    first[0].succeeded(sent.step, None, done)
    sent = step(newcomer)
    assert isinstance(sent, Send)
    newcomer[0].succeeded(sent.step, None, done)
    assert queue_of(client, "wait") == [] and client.fleet.in_flight == 0
    client.close()


# --- cancelling queued requests -----------------------------------------------------------------


def test_cancelling_queued_requests_removes_them_from_the_queue(setup: Any) -> None:
    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
            holder = client.infer_stream(MODEL, MSGS, policy="wait", **HOLD)
            it = holder.__aiter__()
            await it.__anext__()
            tasks: dict[str, asyncio.Task[Any]] = {}
            for i, name in enumerate(["a", "b", "c", "d"]):
                if name == "d":
                    tasks[name] = asyncio.create_task(
                        collect(client.infer_stream(MODEL, MSGS, policy="wait", max_tokens=3)))
                else:
                    tasks[name] = asyncio.create_task(
                        client.infer(MODEL, MSGS, policy="wait", max_tokens=3))
                await await_for(lambda n=i + 1: len(queue_of(client, "wait")) == n, "queueing")
            queue = queue_of(client, "wait")
            tasks["b"].cancel()  # one in the middle
            with pytest.raises(asyncio.CancelledError):
                await tasks["b"]
            assert queue_of(client, "wait") == [queue[0], queue[2], queue[3]]
            tasks["a"].cancel()  # the head
            with pytest.raises(asyncio.CancelledError):
                await tasks["a"]
            tasks["d"].cancel()  # a queued stream
            with pytest.raises(asyncio.CancelledError):
                await tasks["d"]
            assert queue_of(client, "wait") == [queue[2]]
            await it.aclose()
            r = await tasks["c"]
            assert r.routing.queued_ms > 0
            assert queue_of(client, "wait") == []
            assert client.fleet.in_flight == 0

    asyncio.run(main())
    stats = settled(setup.node("solo"))
    # the holder (aborted) and "c": the cancelled requests never reached the node
    assert (stats.requests_total, stats.completed_total, stats.aborted_total) == (2, 1, 1)


def test_queue_wait_counts_against_the_overall_deadline(setup: Any) -> None:
    """No max_queue_ms: the request's own timeout bounds the wait, as ZMLTimeoutError."""
    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
            holder = client.infer_stream(MODEL, MSGS, policy="wait", **HOLD)
            it = holder.__aiter__()
            await it.__anext__()
            with pytest.raises(zml.ZMLTimeoutError):
                await client.infer(MODEL, MSGS, policy="wait", timeout=0.2)
            assert queue_of(client, "wait") == []
            await it.aclose()
            assert client.fleet.in_flight == 0

    asyncio.run(main())
