"""Cancellation reaches the node: every way of walking away from a request closes its connection.

The simulated node counts a request whose client disconnected in ``aborted_total`` and drops it
from its running/waiting gauges; the client releases its slot on every path
(``client.fleet.in_flight == 0``). Node counters are polled until they settle (the node sees
the disconnect asynchronously); the timeouts of the polls are safety nets only.
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Callable
from typing import Any

import pytest

import zml
from tests.conftest import MODEL
from tests.e2e.conftest import await_for, collect, fleet_fixture, settled, wait_for

MSGS = [{"role": "user", "content": "Write a very long essay"}]
LONG = {"max_tokens": 4000, "extra_body": {"ignore_eos": True}}  # seconds of streaming
POLICIES = {"prod": {"accelerator_chain": ["H100"], "cost_priority": "cost"}}


def aborted_and_idle(node: Any, aborted: int) -> Callable[[], bool]:
    """A predicate: the node has aborted ``aborted`` requests and runs or queues none."""

    def check() -> bool:
        s = node.stats
        return s.aborted_total == aborted and s.running == 0 and s.waiting == 0

    return check


setup = fleet_fixture([{"id": "gpu", "family": "H100", "max_concurrency": 4}], POLICIES, 0.1)


# --- sync client --------------------------------------------------------------------------


def sync_break(client: zml.Client) -> None:
    for chunk in client.infer_stream(MODEL, MSGS, policy="prod", **LONG):
        assert chunk.routing.node_id == "gpu"
        break


def sync_close(client: zml.Client) -> None:
    stream = client.infer_stream(MODEL, MSGS, policy="prod", **LONG)
    it = iter(stream)
    next(it)
    next(it)
    stream.close()
    assert list(stream) == []


def sync_close_before_iterating(client: zml.Client) -> None:
    stream = client.infer_stream(MODEL, MSGS, policy="prod", **LONG)
    assert stream.routing is not None
    stream.close()


def sync_drop_without_closing(client: zml.Client) -> None:
    """Dispatched, never read, never closed, dropped: the slot is still given back."""
    stream = client.infer_stream(MODEL, MSGS, policy="prod", **LONG)
    assert stream.routing is not None
    del stream
    gc.collect()


def sync_drop_after_a_chunk(client: zml.Client) -> None:
    stream = client.infer_stream(MODEL, MSGS, policy="prod", **LONG)
    it = iter(stream)
    next(it)
    del stream
    gc.collect()  # the iterator still holds the stream: nothing is released yet
    assert client.fleet.in_flight == 1
    del it
    gc.collect()


def sync_with_exit(client: zml.Client) -> None:
    with client.infer_stream(MODEL, MSGS, policy="prod", **LONG) as stream:
        for i, _ in enumerate(stream):
            if i == 2:
                break


def sync_error_in_loop(client: zml.Client) -> None:
    class Boom(Exception):
        pass

    with pytest.raises(Boom):
        for _ in client.infer_stream(MODEL, MSGS, policy="prod", **LONG):
            raise Boom


@pytest.mark.parametrize(
    "walk_away",
    [sync_break, sync_close, sync_close_before_iterating, sync_drop_without_closing,
     sync_drop_after_a_chunk, sync_with_exit, sync_error_in_loop],
)
def test_sync_cancellation_reaches_the_node(setup: Any, walk_away: Any) -> None:
    node = setup.node("gpu")
    with zml.Client(config=setup.path) as client:
        walk_away(client)
        assert client.fleet.in_flight == 0
        wait_for(aborted_and_idle(node, 1), "the node to abort the request")
        # the slot is usable again, and a full answer still works
        r = client.infer(MODEL, MSGS, policy="prod", max_tokens=5)
        assert r.routing.node_id == "gpu"
        assert client.fleet.in_flight == 0
    s = settled(node)
    assert (s.requests_total, s.completed_total, s.aborted_total) == (2, 1, 1)


# --- async client -------------------------------------------------------------------------


async def async_break(client: zml.AsyncClient) -> None:
    async for chunk in client.infer_stream(MODEL, MSGS, policy="prod", **LONG):
        assert chunk.routing.node_id == "gpu"
        break


async def async_aclose(client: zml.AsyncClient) -> None:
    stream = client.infer_stream(MODEL, MSGS, policy="prod", **LONG)
    it = stream.__aiter__()
    await it.__anext__()
    await stream.aclose()
    await it.aclose()


async def async_with_exit(client: zml.AsyncClient) -> None:
    async with client.infer_stream(MODEL, MSGS, policy="prod", **LONG) as stream:
        assert stream.routing is not None
        async for _ in stream:
            break


async def async_with_exit_without_iterating(client: zml.AsyncClient) -> None:
    async with client.infer_stream(MODEL, MSGS, policy="prod", **LONG) as stream:
        assert stream.routing is not None and stream.routing.node_id == "gpu"


async def async_drop_without_iterating(client: zml.AsyncClient) -> None:
    """Never dispatched: nothing reaches the node; the call still ends (nothing leaks)."""
    stream = client.infer_stream(MODEL, MSGS, policy="prod", **LONG)
    del stream
    gc.collect()
    # this way walks away before dispatch: send one to cancel for the common assertions
    await async_break(client)


async def async_drop_after_a_chunk(client: zml.AsyncClient) -> None:
    stream = client.infer_stream(MODEL, MSGS, policy="prod", **LONG)
    it = stream.__aiter__()
    await it.__anext__()
    del stream, it
    gc.collect()


async def async_cancel_while_iterating(client: zml.AsyncClient) -> None:
    got_first = asyncio.Event()

    async def consume() -> None:
        async for _ in client.infer_stream(MODEL, MSGS, policy="prod", **LONG):
            got_first.set()

    task = asyncio.create_task(consume())
    await got_first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def async_cancel_while_consumer_is_busy(client: zml.AsyncClient) -> None:
    """Cancelled in the consumer's own await, with the stream suspended at a yield."""
    got_first = asyncio.Event()

    async def consume() -> None:
        async for _ in client.infer_stream(MODEL, MSGS, policy="prod", **LONG):
            got_first.set()
            await asyncio.sleep(3600)

    task = asyncio.create_task(consume())
    await got_first.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def async_cancel_infer(client: zml.AsyncClient, node: Any) -> None:
    task = asyncio.create_task(client.infer(MODEL, MSGS, policy="prod", **LONG))
    await await_for(lambda: node.stats.running == 1, "the node to start generating")
    assert client.fleet.in_flight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def async_cancel_before_first_chunk(client: zml.AsyncClient, node: Any) -> None:
    node.set_faults(zml.sim.FaultSpec(stall_s=100.0))  # no first token for 10 s
    stream = client.infer_stream(MODEL, MSGS, policy="prod", **LONG)

    async def consume() -> None:
        async for _ in stream:
            raise AssertionError("no chunk expected")

    task = asyncio.create_task(consume())
    await await_for(lambda: node.stats.running == 1, "the node to take the request")
    assert client.fleet.in_flight == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    node.set_faults(zml.sim.FaultSpec())


ASYNC_WAYS = [
    async_break, async_aclose, async_with_exit, async_with_exit_without_iterating,
    async_drop_without_iterating, async_drop_after_a_chunk,
    async_cancel_while_iterating, async_cancel_while_consumer_is_busy,
    async_cancel_infer, async_cancel_before_first_chunk,
]


@pytest.mark.parametrize("walk_away", ASYNC_WAYS, ids=[f.__name__ for f in ASYNC_WAYS])
def test_async_cancellation_reaches_the_node(setup: Any, walk_away: Any) -> None:
    import zml.sim

    node = setup.node("gpu")

    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
            if walk_away in (async_cancel_infer, async_cancel_before_first_chunk):
                await walk_away(client, node)
            else:
                await walk_away(client)
            await await_for(lambda: client.fleet.in_flight == 0, "the slot to be released")
            await await_for(aborted_and_idle(node, 1), "the node to abort the request")
            r = await client.infer(MODEL, MSGS, policy="prod", max_tokens=5)
            assert r.routing.node_id == "gpu"
            assert client.fleet.in_flight == 0

    asyncio.run(main())
    s = settled(node)
    assert (s.requests_total, s.completed_total, s.aborted_total) == (2, 1, 1)


@pytest.mark.parametrize("kind", ["sync", "async"])
def test_slot_is_free_right_after_leaving_the_loop(sim_fleet: Any, kind: str) -> None:
    """One slot: ``break``, then at once another request. The slot must already be free (an
    async generator left by ``break`` is only closed later, by the event loop)."""
    nodes = [{"id": "solo", "family": "H100", "max_concurrency": 1}]
    setup = sim_fleet(nodes, POLICIES, time_scale=0.1)
    if kind == "sync":
        with zml.Client(config=setup.path) as client:
            for _ in range(3):
                for _ in client.infer_stream(MODEL, MSGS, policy="prod", **LONG):
                    break
                assert client.fleet.in_flight == 0
                r = client.infer(MODEL, MSGS, policy="prod", max_tokens=2)
                assert r.routing.node_id == "solo"
    else:
        async def main() -> None:
            async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
                for _ in range(3):
                    async for _ in client.infer_stream(MODEL, MSGS, policy="prod", **LONG):
                        break
                    assert client.fleet.in_flight == 0  # no await since the break
                    r = await client.infer(MODEL, MSGS, policy="prod", max_tokens=2)
                    assert r.routing.node_id == "solo"

        asyncio.run(main())
    node = setup.node("solo")
    wait_for(aborted_and_idle(node, 3), "the node to abort the three streams")
    assert settled(node).completed_total == 3


def test_cancelled_while_in_the_nodes_queue_is_dropped_from_it(sim_fleet: Any) -> None:
    """max_concurrency=1 on the node, one request generating: the next waits in the node's
    own queue; cancelling it removes it from that queue, the running one carries on."""
    nodes = [{"id": "solo", "family": "H100", "max_concurrency": 1, "max_queue": 2}]
    setup = sim_fleet(nodes, POLICIES, time_scale=0.1)
    node = setup.node("solo")

    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
            holder = client.infer_stream(MODEL, MSGS, policy="prod", max_tokens=300,
                                         extra_body={"ignore_eos": True})
            it = holder.__aiter__()
            await it.__anext__()
            queued = asyncio.create_task(client.infer(MODEL, MSGS, policy="prod", max_tokens=5))
            await await_for(lambda: node.stats.waiting == 1, "the request to queue on the node")
            assert client.fleet.in_flight == 2
            queued.cancel()
            with pytest.raises(asyncio.CancelledError):
                await queued
            await await_for(lambda: node.stats.waiting == 0 and node.stats.aborted_total == 1,
                            "the node to drop the queued request")
            assert node.stats.running == 1  # the holder is still generating
            assert client.fleet.in_flight == 1
            rest = [c async for c in it]
            assert rest and holder.finish_reason == "length"
            assert client.fleet.in_flight == 0

    asyncio.run(main())
    s = settled(node)
    assert (s.requests_total, s.completed_total, s.aborted_total) == (2, 1, 1)


def test_a_thousand_cancelled_streams_release_every_slot(sim_fleet: Any) -> None:
    # A slow token rate (a token every 50 ms, first token after 2 ms): the node must be idle
    # between tokens to notice a disconnect. A node running behind its schedule streams without
    # yielding to its event loop and does not see it (a sim limitation, reported).
    nodes = [{"id": "big", "family": "H100", "max_concurrency": 64,
              "sim": {"ttft_ms": 2.0, "tokens_per_s": 20.0}}]
    setup = sim_fleet(nodes, POLICIES)
    node = setup.node("big")
    total, concurrency = 1000, 48

    async def one(client: zml.AsyncClient, gate: asyncio.Semaphore) -> str:
        async def consume() -> None:
            async for _ in client.infer_stream(MODEL, MSGS, policy="prod", **LONG):
                task.cancel()  # cancelled right after the first chunk, at the next await

        async with gate:
            task = asyncio.create_task(consume())
            try:
                await task
            except asyncio.CancelledError:
                return "cancelled"
            return "finished"

    async def main() -> list[str]:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
            gate = asyncio.Semaphore(concurrency)
            outcomes = await asyncio.gather(*(one(client, gate) for _ in range(total)))
            assert client.fleet.in_flight == 0, client.fleet.status()
            return list(outcomes)

    outcomes = asyncio.run(main())
    assert outcomes.count("cancelled") == total
    wait_for(aborted_and_idle(node, total), f"the node to abort {total} requests ({node.stats})")
    s = settled(node)
    assert (s.requests_total, s.completed_total, s.rejected_total) == (total, 0, 0)
    assert s.running_peak <= 64


def test_break_reaches_the_node_before_the_callers_next_await(setup: Any) -> None:
    """After a bare ``break`` out of ``async for``, the node counts the abort while the caller
    has not awaited anything since (the wait below blocks the event loop): the connection was
    closed by the break itself, not by a cleanup scheduled on the loop."""
    node = setup.node("gpu")

    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
            async for _ in client.infer_stream(MODEL, MSGS, policy="prod", **LONG):
                break
            assert client.fleet.in_flight == 0
            wait_for(aborted_and_idle(node, 1), "the node to abort the request", timeout=5.0)

    asyncio.run(main())
    assert settled(node).aborted_total == 1


def test_dropping_an_async_stream_mid_read_state_closes_it(setup: Any) -> None:
    """Held, partly read, then dropped with no loop turn: the finalizer releases at once."""
    node = setup.node("gpu")

    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
            stream = client.infer_stream(MODEL, MSGS, policy="prod", **LONG)
            await anext(stream)
            await anext(stream)
            assert client.fleet.in_flight == 1
            del stream
            assert client.fleet.in_flight == 0
            wait_for(aborted_and_idle(node, 1), "the node to abort the request", timeout=5.0)

    asyncio.run(main())


# --- closed by another task or thread, while this one reads -------------------------------


class _Endings:
    """Counts the terminal hooks of each call."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    @zml.hookimpl
    def zml_request_completed(self, call: Any) -> None:
        self.seen.append("completed")

    @zml.hookimpl
    def zml_request_cancelled(self, call: Any) -> None:
        self.seen.append("cancelled")

    @zml.hookimpl
    def zml_request_failed(self, call: Any) -> None:
        self.seen.append("failed")


@pytest.mark.parametrize("when", ["opening", "mid-stream"])
def test_aclose_from_another_task_ends_the_readers_stream_once(setup: Any, when: str) -> None:
    """The reader's loop ends (no chunk after the close, no error blaming the node), exactly one
    ``cancelled`` fires, the node drops the request and its health is untouched."""
    import zml.sim

    node = setup.node("gpu")
    if when == "opening":
        # No first token for 100 s: aclose() stops the opening itself (its connection is
        # shut down), so the reader ends long before that, with no chunk.
        node.set_faults(zml.sim.FaultSpec(stall_s=1000.0))
    endings = _Endings()

    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
            client.plugins.register(endings)
            stream = client.infer_stream(MODEL, MSGS, policy="prod", **LONG)
            read: list[Any] = []

            async def reader() -> None:
                async for chunk in stream:
                    read.append(chunk)

            task = asyncio.create_task(reader())
            if when == "opening":
                await await_for(lambda: node.stats.running == 1, "the node to take it")
            else:
                await await_for(lambda: len(read) >= 2, "two chunks")
            await stream.aclose()
            count = len(read)
            await asyncio.wait_for(task, 10)  # ends, without raising
            assert len(read) == count
            assert client.fleet.in_flight == 0
            await await_for(aborted_and_idle(node, 1), "the node to abort the request")
            assert client.fleet.status()[0]["health"] == 1.0

    asyncio.run(main())
    assert endings.seen == ["cancelled"]


def test_close_from_another_thread_ends_the_readers_stream_without_blaming_the_node(
        setup: Any) -> None:
    import threading

    node = setup.node("gpu")
    endings = _Endings()
    with zml.Client(config=setup.path, probe_interval_s=None) as client:
        client.plugins.register(endings)
        stream = client.infer_stream(MODEL, MSGS, policy="prod", **LONG)
        read: list[Any] = []
        errors: list[BaseException] = []

        def reader() -> None:
            try:
                for chunk in stream:
                    read.append(chunk)
            except BaseException as exc:  # recorded for the assertion below
                errors.append(exc)

        thread = threading.Thread(target=reader)
        thread.start()
        wait_for(lambda: len(read) >= 2, "two chunks")
        stream.close()
        thread.join(10)
        assert not thread.is_alive() and errors == []
        assert client.fleet.in_flight == 0
        wait_for(aborted_and_idle(node, 1), "the node to abort the request")
        assert client.fleet.status()[0]["health"] == 1.0
    assert endings.seen == ["cancelled"]


def test_aclose_while_another_task_opens_tries_no_other_node(hostile: Any, tmp_path: Any) -> None:
    """The opening attempt's connection is shut down by the close: that failure is the
    caller's, so the next node of the chain is not tried and the first is not blamed."""
    from tests.e2e.hostile import write_config

    config = write_config(tmp_path / "zml.toml", hostile, {"a": "stall", "b": "ok"})

    async def main() -> None:
        async with zml.AsyncClient(config=config, timeout=600, probe_interval_s=None) as client:
            stream = client.infer_stream(MODEL, MSGS, policy="hostile")
            task = asyncio.create_task(collect(stream))
            await await_for(lambda: len(hostile.requests_for("stall")) == 1, "the request")
            await stream.aclose()
            assert await asyncio.wait_for(task, 30) == []
            node = client.fleet.node("a")
            assert node.health == 1.0 and node.consecutive_failures == 0
            assert client.fleet.in_flight == 0
        assert hostile.requests_for("ok") == []

    asyncio.run(main())


def test_aclose_ends_another_task_s_wait_in_the_saturation_queue(sim_fleet: Any) -> None:
    setup = sim_fleet([{"id": "solo", "family": "H100", "max_concurrency": 1}],
                      {"wait": {"accelerator_chain": ["H100"], "queue_on_saturation": True,
                                "max_queue_ms": 600000}}, time_scale=0.1)

    async def main() -> None:
        async with zml.AsyncClient(config=setup.path, timeout=600,
                                   probe_interval_s=None) as client:
            holder = client.infer_stream(MODEL, MSGS, policy="wait", **LONG)
            held = holder.__aiter__()
            await held.__anext__()
            queued = client.infer_stream(MODEL, MSGS, policy="wait", max_tokens=3)
            task = asyncio.create_task(collect(queued))
            queues = client._dispatcher.effects.queues
            await await_for(lambda: len(queues.queued("wait")) == 1, "the queue")
            await queued.aclose()
            assert await asyncio.wait_for(task, 30) == []
            assert queues.queued("wait") == []
            await holder.aclose()
            assert client.fleet.in_flight == 0

    asyncio.run(main())
    assert settled(setup.node("solo")).requests_total == 1  # the queued one was never sent
