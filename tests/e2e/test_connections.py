"""Connection reuse on real loopback sockets: one node, sequential requests, one connection.

Counts TCP connects with httpcore2's public ``trace`` request extension, set by an httpx2
request hook on a client built over :class:`zml.connections.NodePools` (the transport the
async client uses by default).
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import httpx2
import pytest

import zml
from tests.conftest import MODEL
from zml.connections import NodePools, _readable, async_http_client

NODES = [{"id": "h100-a", "family": "H100", "max_concurrency": 4}]
MSGS = [{"role": "user", "content": "hello"}]


def connect_counter() -> tuple[Callable[[httpx2.Request], Awaitable[None]], list[str]]:
    """A request hook that has httpcore2 report each TCP connect, and the list it appends to."""
    connects: list[str] = []

    async def trace(name: str, info: dict[str, Any]) -> None:
        if name == "connection.connect_tcp.complete":
            connects.append(name)

    async def hook(request: httpx2.Request) -> None:
        request.extensions["trace"] = trace

    return hook, connects


def counting_client() -> tuple[httpx2.AsyncClient, list[str]]:
    hook, connects = connect_counter()
    http = httpx2.AsyncClient(transport=NodePools(httpx2.Limits(max_keepalive_connections=8)),
                              event_hooks={"request": [hook]})
    return http, connects


async def test_complete_streams_and_answers_reuse_one_connection(sim_fleet: Any) -> None:
    setup = sim_fleet(NODES, time_scale=0.01)
    http, connects = counting_client()
    async with zml.AsyncClient(config=setup.path, http_client=http, probe_interval_s=None) \
            as client:
        for _ in range(5):
            text = ""
            async for chunk in client.infer_stream(MODEL, MSGS, max_tokens=6):
                for choice in chunk.choices:
                    text += choice.delta.content or ""
            assert text
            answer = await client.infer(MODEL, MSGS, max_tokens=4)
            assert answer.choices[0].message.content
    await http.aclose()
    assert connects == ["connection.connect_tcp.complete"]


async def test_the_default_pool_lets_go_of_a_connection_before_the_node_does(
    sim_fleet: Any,
) -> None:
    # The simulated node is served by uvicorn, which closes a connection idle for 5 s (as
    # vLLM's server does). zml's own pool reuses a connection idle for less than 4 s, and
    # opens a new one past that, rather than race the node's close.
    setup = sim_fleet(NODES, time_scale=0.01)
    hook, connects = connect_counter()
    async with zml.AsyncClient(config=setup.path, probe_interval_s=None) as client:
        client._http.event_hooks["request"].append(hook)
        for pause in (0.0, 1.0, 4.4):
            await asyncio.sleep(pause)
            answer = await client.infer(MODEL, MSGS, max_tokens=2)
            assert answer.choices[0].message.content
    assert len(connects) == 2  # the first request's, and the one after 4.4 s idle


async def test_node_pools_keep_one_pool_per_origin(sim_fleet: Any) -> None:
    setup = sim_fleet([{"id": "a", "family": "H100", "max_concurrency": 2},
                       {"id": "b", "family": "H100", "max_concurrency": 2}])
    http, connects = counting_client()
    async with http:
        for node in ("a", "b", "a", "b"):
            r = await http.get(setup.fleet.url(node) + "/health")
            assert r.status_code == 200
    assert len(connects) == 2


def test_readable_reports_a_closed_peer_and_not_an_idle_one() -> None:
    ours, theirs = socket.socketpair()
    with ours:
        assert not _readable(ours)
        theirs.close()
        assert _readable(ours)
    assert _readable(ours)  # closed here: the pool must drop it
    assert _readable(None)


def test_environment_proxies_keep_the_plain_client(monkeypatch: Any) -> None:
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    client = async_http_client(httpx2.Limits())
    assert not isinstance(client._transport, NodePools)  # httpx2 mounts the proxy itself
    monkeypatch.delenv("HTTP_PROXY")
    monkeypatch.delenv("http_proxy", raising=False)
    assert isinstance(async_http_client(httpx2.Limits())._transport, NodePools)


@pytest.mark.filterwarnings("error::ResourceWarning")
def test_a_sync_client_dropped_unclosed_closes_its_connections_and_stops_probing(
    sim_fleet: Any,
) -> None:
    import gc
    import threading
    import warnings

    setup = sim_fleet(NODES, time_scale=0.01)
    client = zml.Client(config=setup.path, probe_interval_s=0.05)
    assert client.infer(MODEL, MSGS, max_tokens=4).choices[0].message.content  # a connection
    prober = next(t for t in threading.enumerate() if t.name == "zml-prober")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        del client
        gc.collect()
        prober.join(10)  # the prober lets go of the HTTP client as it ends
        gc.collect()
    assert not prober.is_alive()
    assert [w for w in caught if issubclass(w.category, ResourceWarning)] == []


def test_an_async_client_serves_one_asyncio_run_after_another(sim_fleet: Any) -> None:
    """Each ``asyncio.run`` has its own event loop, and connections of a closed loop cannot be
    used: the client's pools start afresh on the new loop, instead of failing the next request
    with ``RuntimeError: Event loop is closed``."""
    setup = sim_fleet(NODES, time_scale=0.01)
    client = zml.AsyncClient(config=setup.path)  # probing on: its task dies with each loop

    async def both() -> tuple[str, int]:
        r = await client.infer(MODEL, MSGS, max_tokens=3)
        chunks = [c async for c in client.infer_stream(MODEL, MSGS, max_tokens=3)]
        return r.choices[0].message.content or "", len(chunks)

    for _ in range(3):
        content, chunks = asyncio.run(both())
        assert content and chunks >= 3
    assert client.fleet.in_flight == 0
    assert setup.node("h100-a").stats.completed_total == 6
    asyncio.run(client.aclose())
