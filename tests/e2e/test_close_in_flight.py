"""Closing a client with calls in flight ends each of them at once, with one typed error.

``close()`` (from another thread) or ``aclose()`` (from another task) while a call waits for a
node, reads a stream, waits out a Retry-After or waits in a saturation queue: the call raises
``ClientConfigError`` ("closed ... while the call was in flight"), no other node is tried, the
node is not blamed (health, failures, circuit untouched: a shared ``fleet=`` stays clean) and
the slot is freed. Every call here has a long deadline, so ending in time is shown by the error
type (not a ZMLTimeoutError); the waits are safety nets only.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import zml
from tests.conftest import MODEL
from tests.e2e.conftest import await_for, fleet_fixture, settled, wait_for
from tests.e2e.hostile import HostileNode, write_config

MSGS = [{"role": "user", "content": "hi"}]
LONG = {"max_tokens": 4000, "extra_body": {"ignore_eos": True}}  # seconds of streaming
IN_FLIGHT = "or the end of its `with` block) while the call was in flight"


def _unblamed(client: zml.Client | zml.AsyncClient, node_id: str) -> None:
    node = client.fleet.node(node_id)
    assert node.health == 1.0 and node.consecutive_failures == 0
    assert node.circuit_state == "closed"
    assert client.fleet.in_flight == 0


def _in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}

    def run() -> None:
        try:
            out["value"] = fn()
        except BaseException as exc:  # the test looks at it
            out["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


# --- a node that never answers, then a healthy one the call must not fail over to ------------


@pytest.fixture
def stall_config(hostile: HostileNode, tmp_path: Path) -> Path:
    return write_config(tmp_path / "zml.toml", hostile, {"a": "stall", "b": "ok"})


@pytest.mark.parametrize("timeout", [600.0, None], ids=["deadline", "no-deadline"])
@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_close_from_another_thread_ends_a_call_waiting_for_a_node(
        hostile: HostileNode, stall_config: Path, stream: bool, timeout: float | None) -> None:
    client = zml.Client(config=stall_config, timeout=timeout, probe_interval_s=None)

    def call() -> Any:
        if stream:
            return list(client.infer_stream(MODEL, MSGS, policy="hostile"))
        return client.infer(MODEL, MSGS, policy="hostile")

    thread, out = _in_thread(call)
    wait_for(lambda: len(hostile.requests_for("stall")) == 1, "the request to reach the node")
    client.close()
    thread.join(30)
    assert not thread.is_alive()
    error = out.get("error")
    assert isinstance(error, zml.ClientConfigError), out
    assert "this Client was closed (close() " in str(error) and IN_FLIGHT in str(error)
    assert hostile.requests_for("ok") == []  # no failover
    _unblamed(client, "a")


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_aclose_from_another_task_ends_a_call_waiting_for_a_node(
        hostile: HostileNode, stall_config: Path, stream: bool) -> None:
    async def main() -> None:
        client = zml.AsyncClient(config=stall_config, timeout=600, probe_interval_s=None)

        async def call() -> Any:
            if stream:
                return [c async for c in client.infer_stream(MODEL, MSGS, policy="hostile")]
            return await client.infer(MODEL, MSGS, policy="hostile")

        task = asyncio.create_task(call())
        await await_for(lambda: len(hostile.requests_for("stall")) == 1, "the request")
        await client.aclose()
        with pytest.raises(zml.ClientConfigError, match="this AsyncClient was closed"):
            await asyncio.wait_for(task, 30)
        assert hostile.requests_for("ok") == []
        _unblamed(client, "a")

    asyncio.run(main())


def test_close_ends_a_retry_after_wait(hostile: HostileNode, tmp_path: Path) -> None:
    config = write_config(tmp_path / "zml.toml", hostile, {"a": "retry-after=300"})
    client = zml.Client(config=config, timeout=600, probe_interval_s=None)
    thread, out = _in_thread(lambda: client.infer(MODEL, MSGS, policy="hostile"))
    wait_for(lambda: len(hostile.requests_for("retry-after=300")) == 1, "the 429")
    client.close()
    thread.join(30)
    assert isinstance(out.get("error"), zml.ClientConfigError), out
    assert len(hostile.requests_for("retry-after=300")) == 1  # not retried after the close


def test_aclose_ends_a_retry_after_wait(hostile: HostileNode, tmp_path: Path) -> None:
    config = write_config(tmp_path / "zml.toml", hostile, {"a": "retry-after=300"})

    async def main() -> None:
        client = zml.AsyncClient(config=config, timeout=600, probe_interval_s=None)
        task = asyncio.create_task(client.infer(MODEL, MSGS, policy="hostile"))
        await await_for(lambda: len(hostile.requests_for("retry-after=300")) == 1, "the 429")
        await client.aclose()
        with pytest.raises(zml.ClientConfigError, match=re.escape(IN_FLIGHT)):
            await asyncio.wait_for(task, 30)

    asyncio.run(main())


# --- a stream mid-way, and a call queued behind it, on one simulated node -----------------------

QUEUE = {"wait": {"accelerator_chain": ["H100"], "queue_on_saturation": True,
                  "max_queue_ms": 600000}}
setup = fleet_fixture([{"id": "solo", "family": "H100", "max_concurrency": 1}], QUEUE, 0.1)


def test_close_ends_a_stream_mid_way_and_a_queued_call(setup: Any) -> None:
    client = zml.Client(config=setup.path, timeout=600, probe_interval_s=None)
    started = threading.Event()

    def read() -> int:
        n = 0
        for _ in client.infer_stream(MODEL, MSGS, policy="wait", **LONG):
            n += 1
            started.set()
        return n

    reader, read_out = _in_thread(read)
    assert started.wait(30)
    queued, queued_out = _in_thread(lambda: client.infer(MODEL, MSGS, policy="wait"))
    wait_for(lambda: len(client._dispatcher.effects.queues.queued("wait")) == 1, "the queue")
    client.close()
    reader.join(30)
    queued.join(30)
    for out in (read_out, queued_out):
        assert isinstance(out.get("error"), zml.ClientConfigError), out
        assert IN_FLIGHT in str(out["error"])
    stats = settled(setup.node("solo"))
    assert stats.requests_total == 1 and stats.aborted_total == 1  # the node saw the close
    _unblamed(client, "solo")


def test_aclose_ends_a_stream_mid_way_and_a_queued_call(setup: Any) -> None:
    async def main() -> None:
        client = zml.AsyncClient(config=setup.path, timeout=600, probe_interval_s=None)
        first = asyncio.Event()

        async def read() -> int:
            n = 0
            async for _ in client.infer_stream(MODEL, MSGS, policy="wait", **LONG):
                n += 1
                first.set()
            return n

        reader = asyncio.create_task(read())
        await asyncio.wait_for(first.wait(), 30)
        queued = asyncio.create_task(client.infer(MODEL, MSGS, policy="wait"))
        await await_for(lambda: len(client._dispatcher.effects.queues.queued("wait")) == 1,
                        "the queue")
        await client.aclose()
        for task in (reader, queued):
            with pytest.raises(zml.ClientConfigError, match=re.escape(IN_FLIGHT)):
                await asyncio.wait_for(task, 30)
        _unblamed(client, "solo")

    asyncio.run(main())
    stats = settled(setup.node("solo"))
    assert stats.requests_total == 1 and stats.aborted_total == 1


def test_a_shared_fleet_outlives_a_client_closed_mid_call(hostile: HostileNode,
                                                          stall_config: Path) -> None:
    """The other client on the same fleet still routes to the node the closed call was on."""
    owner = zml.Client(config=stall_config, timeout=600, probe_interval_s=None)
    other = zml.Client(fleet=owner.fleet, timeout=600, probe_interval_s=None)
    thread, out = _in_thread(lambda: other.infer(MODEL, MSGS, policy="hostile"))
    wait_for(lambda: len(hostile.requests_for("stall")) == 1, "the request")
    other.close()
    thread.join(30)
    assert isinstance(out.get("error"), zml.ClientConfigError), out
    _unblamed(owner, "a")
    decision = owner.explain(MODEL, policy="hostile")
    assert isinstance(decision, zml.routing.Decision) and decision.node.id == "a"
    owner.close()
