"""Connection reuse on real loopback sockets: one node, sequential requests, one connection.

Counts TCP connects with httpcore2's public ``trace`` request extension, set by an httpx2
request hook on a client built over :class:`zml.connections.NodePools` (the transport the
async client uses by default).
"""

from __future__ import annotations

import asyncio
import inspect
import socket
from collections.abc import Awaitable, Callable
from typing import Any

import httpx2
import pytest

import zml
from tests.conftest import MODEL
from zml.connections import (
    _HOLD_MAX,
    NodePools,
    SyncNodePools,
    _readable,
    async_http_client,
)

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


class _Writes:
    """Wraps a pool's real network backend and records what its connections send: ``sizes``,
    the buffers handed to the socket's writer (the asyncio transport of an async stream, the
    sync stream's ``write``), and ``through_anyio``, those written through anyio's stream."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.sizes: list[int] = []
        self.through_anyio: list[int] = []

    def _recording(self, write: Callable[..., Any], into: list[int]) -> Callable[..., Any]:
        if inspect.iscoroutinefunction(write):
            async def awrite(buffer: bytes, *args: Any) -> None:
                into.append(len(buffer))
                await write(buffer, *args)
            return awrite

        def swrite(buffer: bytes, *args: Any) -> None:
            into.append(len(buffer))
            write(buffer, *args)
        return swrite

    def connect_tcp(self, *args: Any, **kwargs: Any) -> Any:
        made = self.inner.connect_tcp(*args, **kwargs)
        if not asyncio.iscoroutine(made):
            made.write = self._recording(made.write, self.sizes)
            return made

        async def connected() -> Any:
            stream = await made
            transport = stream._stream._transport  # anyio's SocketStream's asyncio transport
            transport.write = self._recording(transport.write, self.sizes)
            stream.write = self._recording(stream.write, self.through_anyio)
            return stream
        return connected()


def _count_writes(pools: NodePools | SyncNodePools, url: str) -> _Writes:
    backend = pools._pool(httpx2.URL(url))._pool._network_backend  # type: ignore[attr-defined]
    writes = _Writes(backend._inner)
    backend._inner = writes
    return writes


@pytest.mark.parametrize("size", [100, 3 * _HOLD_MAX])
async def test_the_async_pools_send_a_request_in_one_write_up_to_64_kib(
    sim_fleet: Any, size: int
) -> None:
    # httpcore2 writes headers, body and the body's end apart (each through anyio's send,
    # with its checkpoints): here a request up to 64 KiB is one write to the transport.
    setup = sim_fleet(NODES, time_scale=0.01)
    pools = NodePools(httpx2.Limits(max_keepalive_connections=8))
    http = httpx2.AsyncClient(transport=pools)
    pools._moved(asyncio.get_running_loop())  # (pools start afresh on a new loop)
    writes = _count_writes(pools, setup.fleet.url("h100-a"))
    async with zml.AsyncClient(config=setup.path, http_client=http, probe_interval_s=None) \
            as client:
        msgs = [{"role": "user", "content": "x" * size}]
        for _ in range(2):
            answer = await client.infer(MODEL, msgs, max_tokens=3)
            assert answer.choices[0].message.content  # the node read the whole body
        chunks = [c async for c in client.infer_stream(MODEL, msgs, max_tokens=3)]
        assert len(chunks) >= 3
    await http.aclose()
    if size < _HOLD_MAX:
        assert len(writes.sizes) == 3 and min(writes.sizes) > size
        assert writes.through_anyio == []  # written to the transport directly
    else:  # the headers, then the large body as it is (not copied), through anyio
        assert len(writes.sizes) == 6
        assert max(writes.sizes[0::2]) < 1024 and min(writes.sizes[1::2]) > size
        assert writes.through_anyio == writes.sizes[1::2]


def test_under_uvloop_a_held_request_goes_straight_to_the_transport(sim_fleet: Any) -> None:
    # The gateway serves on uvloop (zmlai[gateway]), whose transports are not asyncio's
    # classes; its client's requests still skip anyio's send.
    import uvloop

    setup = sim_fleet(NODES, time_scale=0.01)
    through_anyio: list[int] = []

    class Recording(_Writes):
        def connect_tcp(self, *args: Any, **kwargs: Any) -> Any:
            async def connected() -> Any:
                stream = await self.inner.connect_tcp(*args, **kwargs)
                stream.write = self._recording(stream.write, through_anyio)
                return stream
            return connected()

    async def main() -> tuple[str, list[Any]]:
        pools = NodePools(httpx2.Limits(max_keepalive_connections=8))
        pools._moved(asyncio.get_running_loop())
        backend = pools._pool(httpx2.URL(setup.fleet.url("h100-a")))._pool._network_backend
        backend._inner = Recording(backend._inner)
        http = httpx2.AsyncClient(transport=pools)
        async with zml.AsyncClient(config=setup.path, http_client=http,
                                   probe_interval_s=None) as client:
            answer = await client.infer(MODEL, MSGS, max_tokens=3)
            r = await http.get(setup.fleet.url("h100-a") + "/health")
            direct = [r.extensions["network_stream"]._direct]
        await http.aclose()
        return answer.choices[0].message.content or "", direct

    content, direct = uvloop.run(main())
    assert content and direct[0] is not None
    assert through_anyio == []


def test_the_sync_pools_send_a_request_in_one_write(sim_fleet: Any) -> None:
    setup = sim_fleet(NODES, time_scale=0.01)
    pools = SyncNodePools(httpx2.Limits(max_keepalive_connections=8))
    writes = _count_writes(pools, setup.fleet.url("h100-a"))
    with httpx2.Client(transport=pools) as http, \
            zml.Client(config=setup.path, http_client=http, probe_interval_s=None) as client:
        for _ in range(3):
            assert client.infer(MODEL, MSGS, max_tokens=3).choices[0].message.content
        assert len(list(client.infer_stream(MODEL, MSGS, max_tokens=3))) >= 3
    assert len(writes.sizes) == 4


class _Refusing:
    """A network stream whose writes fail (the node closed) but which has an answer to read."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.writes = 0

    def get_extra_info(self, info: str) -> Any:
        return None

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        import httpcore2

        self.writes += 1
        raise httpcore2.WriteError("broken pipe")

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        answer, self.answer = self.answer, b""
        return answer


async def test_a_held_request_that_cannot_be_sent_still_reads_the_nodes_answer() -> None:
    # As httpcore2 passes over a failed write (a node may answer, say 413, and close before
    # it reads the whole request), so does the send that a held request makes at the read.
    from zml.connections import _FastStream

    inner = _Refusing(b"HTTP/1.1 413 Payload Too Large\r\ncontent-length: 0\r\n\r\n")
    stream = _FastStream(inner, NodePools(httpx2.Limits())._sending)
    await stream.write(b"POST / HTTP/1.1\r\n\r\n")
    await stream.write(b"{}")
    assert inner.writes == 0
    assert (await stream.read(4096)).startswith(b"HTTP/1.1 413")
    assert inner.writes == 1
    assert await stream.read(4096) == b""  # later reads go straight to the stream
    assert inner.writes == 1


class _Transport(asyncio.WriteTransport):
    def __init__(self) -> None:
        super().__init__()
        self.sent: list[bytes] = []
        self.closing = False

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.sent.append(bytes(data))

    def is_closing(self) -> bool:
        return self.closing


class _AnyioLike:
    """The shape of httpcore2's anyio stream over anyio's SocketStream, with a fake transport."""

    def __init__(self) -> None:
        self._stream = type("SocketStream", (), {})()
        self._stream._transport = _Transport()
        self._stream._protocol = type("Protocol", (), {"exception": None})()
        self._stream._protocol.write_event = asyncio.Event()
        self._stream._protocol.write_event.set()
        self.through_anyio: list[bytes] = []

    def get_extra_info(self, info: str) -> Any:
        return None

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        self.through_anyio.append(buffer)

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        return b"HTTP/1.1 200 OK\r\n"


async def test_a_held_request_goes_through_anyio_when_the_transport_cannot_take_it_now() -> None:
    from zml.connections import _FastStream

    inner = _AnyioLike()
    transport = inner._stream._transport
    protocol = inner._stream._protocol
    stream = _FastStream(inner, NodePools(httpx2.Limits())._sending)

    async def request() -> None:
        await stream.write(b"GET / HTTP/1.1\r\n\r\n")
        assert await stream.read(4096)

    await request()  # the transport takes writes: one write, straight to it
    assert transport.sent == [b"GET / HTTP/1.1\r\n\r\n"] and inner.through_anyio == []
    protocol.write_event.clear()  # paused (its buffer is full): anyio's send waits for it
    await request()
    protocol.write_event.set()
    transport.closing = True  # closing: anyio's send says so (a WriteError)
    await request()
    protocol.exception = ConnectionResetError()
    transport.closing = False
    await request()
    assert len(transport.sent) == 1 and len(inner.through_anyio) == 3


def test_what_a_write_sends_at_once_is_decided_in_one_place() -> None:
    from zml.connections import _Held

    held = _Held()
    assert held.admit(b"headers", 1.0) == (None, None)  # held for the read
    assert held.admit(b"body", 2.0) == (None, None)
    assert (held.take(), held.timeout) == (b"headersbody", 2.0)
    big = b"x" * _HOLD_MAX
    assert held.admit(big, None) == (None, big)  # a large chunk, nothing held before it
    assert held.admit(b"h", None) == (None, None)
    assert held.admit(big, None) == (b"h", big)  # what was held first, then the chunk as it is
    small = b"y" * (_HOLD_MAX // 2 + 1)
    assert held.admit(small, None) == (None, None)
    assert held.admit(small, None) == (small + small, None)  # 64 KiB reached: all at once
    assert held.parts == [] and held.size == 0
