"""The async client's connections: one HTTP/1.1 pool per node, with a cheap liveness check.

Why not one ``httpx2.AsyncClient`` pool for the whole fleet: httpcore2's pool looks at *every*
connection it holds each time a request is queued or a response is closed (to drop expired or
server-closed ones), and for each idle connection it asks the network stream whether the
socket is readable. Through anyio that question builds the stream's whole attribute table
(about 15 us), so at 64 requests in flight one request paid for some 60 such checks, and the
cost grew with concurrency and with the number of nodes. Here:

* :class:`NodePools` keeps one ``httpx2.AsyncHTTPTransport`` per origin (scheme, host, port),
  so a pool's scan covers only one node's connections; all of them share one TLS context,
  built the first time an ``https`` node is used (a fleet of ``http`` nodes never builds one);
* each pool's network backend is wrapped by :class:`_FastBackend`, whose streams answer
  ``socket`` and ``is_readable`` from the socket remembered at connect time (one ``poll``);
* a request goes out in one write: httpcore2 writes its headers, its body and the body's end
  separately, each a ``send`` of its own (on loopback some 30-40 us of CPU each) and, through
  anyio, two checkpoints and a cancel scope. The streams of both kinds of pools hold what is
  written (:class:`_Held`) and send it with the first read of the response, or as soon as
  64 KiB are held; a chunk of 64 KiB or more goes as it is (a large body is not copied). An
  async plain-TCP stream hands a held request straight to its asyncio transport when that
  takes writes (:func:`_asyncio_transport`). A failed send at the read is passed over as
  httpcore2 passes over a failed write: the node may have answered before it closed.

Both kinds of pools (sync and async) also record, in the extensions of each request they send,
the network stream it goes out on (``network_stream``, the key httpcore2 uses for the
response's): the deadline watchdog (:mod:`zml.watchdog`) watches a request from before it is
sent, and so can shut its connection down while the node still drips (or withholds) the
response's headers. Which request a stream is writing for is known from a context variable of
the pools, set around each request (a thread, or a task, sends one request at a time on one
HTTP/1.1 connection).

Everything else (request and response mapping, errors, timeouts, keep-alive expiry) is
httpx2's own transport. Environment proxies (``HTTP_PROXY``...) are honoured by not using this
module at all: :func:`async_http_client` then builds a plain ``httpx2.AsyncClient``.
"""

from __future__ import annotations

import contextlib
import contextvars
import select
import ssl
import urllib.request
from collections.abc import Iterable
from typing import Any

import httpx2

__all__ = ["NodePools", "SyncNodePools", "async_http_client", "sync_http_client"]


def async_http_client(limits: httpx2.Limits) -> httpx2.AsyncClient:
    """The async client's own HTTP client: per-node pools unless a proxy is configured."""
    if urllib.request.getproxies():
        return httpx2.AsyncClient(limits=limits)
    return httpx2.AsyncClient(transport=NodePools(limits))


def sync_http_client(limits: httpx2.Limits) -> httpx2.Client:
    """The sync client's own HTTP client: per-node pools unless a proxy is configured.

    httpcore2's sync backend answers its liveness question cheaply already; what the sync
    client gains is the per-node scan, a request sent in one write, and no TLS context for a
    fleet of ``http`` nodes (loading the CA bundle is a good part of a first request's cost).
    """
    if urllib.request.getproxies():
        return httpx2.Client(limits=limits)
    return httpx2.Client(transport=SyncNodePools(limits))


def _readable(sock: Any) -> bool:
    """Whether an idle connection's socket has something to read (for HTTP/1.1: the server
    closed it). A socket that is gone counts as readable, so the pool drops the connection."""
    if sock is None:
        return True
    try:
        if sock.fileno() < 0:
            return True
        poller = getattr(select, "poll", None)
        if poller is None:  # pragma: no cover - Windows
            return bool(select.select([sock], [], [], 0)[0])
        p = poller()
        p.register(sock, select.POLLIN)
        return bool(p.poll(0))
    except (OSError, ValueError):
        return True


_Sending = contextvars.ContextVar[Any]
"""The request a thread or task is sending through the pools (None: none)."""


def _note(sending: _Sending, stream: Any) -> None:
    """``stream`` writes: record it in the extensions of the request being sent, if any."""
    request = sending.get()
    if request is not None:
        request.extensions["network_stream"] = stream


def _backend_types() -> tuple[type, type, type, type] | None:
    try:
        import httpcore2
    except ImportError:  # pragma: no cover - httpx2 always brings it
        return None
    return (httpcore2.AsyncNetworkBackend, httpcore2.AsyncNetworkStream,
            httpcore2.NetworkBackend, httpcore2.NetworkStream)


_TYPES = _backend_types()

_HOLD_MAX = 64 * 1024
"""Held request bytes beyond which they are sent at once (see :class:`_Held`)."""


class _Held:
    """The request bytes a stream was asked to write and has not sent yet.

    httpcore2 writes a request (headers, then each body chunk, then the body's end) before it
    reads any of the response, on an HTTP/1.1 connection that carries one request at a time;
    so holding the writes until the first read sends the request whole, and changes nothing
    the node sees but the number of packets.
    """

    __slots__ = ("parts", "size", "timeout")

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.size = 0
        self.timeout: float | None = None

    def admit(self, buffer: bytes, timeout: float | None) -> tuple[bytes | None, bytes | None]:
        """A write of ``buffer`` (not empty): what to send at once, as ``(held, large)``.

        ``(None, None)``: ``buffer`` is held, for the read to send. Else send ``held`` (what
        was held, ``buffer`` included once 64 KiB are reached), then ``large`` (a chunk of
        64 KiB or more, sent as it is rather than copied), whichever is not None.
        """
        if len(buffer) >= _HOLD_MAX:
            return (self.take() if self.parts else None), buffer
        self.parts.append(buffer)
        self.size += len(buffer)
        self.timeout = timeout  # the write timeout of the request's last write
        if self.size < _HOLD_MAX:
            return None, None
        return self.take(), None

    def take(self) -> bytes:
        """The held bytes, as one buffer (and hold nothing)."""
        parts = self.parts
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        self.parts = []
        self.size = 0
        return data


def _asyncio_transport(stream: Any) -> tuple[Any, Any] | None:
    """The asyncio transport and protocol under httpcore2's anyio stream ``stream``, when it
    is a plain TCP one (None for TLS, another backend, or anyio internals of another shape).

    What anyio's ``SocketStream.send`` does when the socket is writable is one
    ``transport.write``; around it, it passes two checkpoints (a shielded cancel scope and an
    event-loop turn) and httpcore2 adds a cancel scope for the write timeout, some 20 us of CPU
    per request on their own. A held request (at most 64 KiB) is written to the transport the
    same way, without them, when the protocol takes writes (else anyio's own send waits for
    it): the read that follows at once is where the task waits and can be cancelled.
    """
    import asyncio  # (only the async pools call this: asyncio is loaded)

    raw = getattr(stream, "_stream", None)
    transport = getattr(raw, "_transport", None)
    protocol = getattr(raw, "_protocol", None)
    # uvloop's transports (the gateway's loop) are not asyncio.Transport subclasses: the
    # transport is known by what anyio itself calls on it.
    if callable(getattr(transport, "write", None)) \
            and callable(getattr(transport, "is_closing", None)) \
            and isinstance(getattr(protocol, "write_event", None), asyncio.Event) \
            and hasattr(protocol, "exception"):
        return transport, protocol
    return None


if _TYPES is not None:
    from httpcore2 import WriteError as _WriteError

    _Backend, _StreamBase, _SyncBackendBase, _SyncStreamBase = _TYPES

    class _FastStream(_StreamBase):  # type: ignore[misc, valid-type]
        """A network stream that remembers its socket, records the requests it sends and sends
        each in one write (the rest is the wrapped stream's)."""

        def __init__(self, inner: Any, sending: _Sending) -> None:
            self._inner = inner
            self._sending = sending
            self._sock = inner.get_extra_info("socket")
            self._held = _Held()
            self._direct = _asyncio_transport(inner)
            # Reads go straight to the wrapped stream (no extra coroutine per read) unless
            # written bytes are held (then the read sends them first).
            self.read = inner.read  # type: ignore[method-assign]

        async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            data: bytes = await self._inner.read(max_bytes, timeout)
            return data

        async def write(self, buffer: bytes, timeout: float | None = None) -> None:
            _note(self._sending, self)
            if not buffer:
                return
            held, large = self._held.admit(buffer, timeout)
            if held is None and large is None:
                self.read = self._send_then_read  # type: ignore[method-assign]
                return
            self.read = self._inner.read  # type: ignore[method-assign]
            if held is not None:
                await self._send(held, self._held.timeout)
            if large is not None:
                await self._inner.write(large, timeout)

        async def _send(self, data: bytes, timeout: float | None) -> None:
            """Send held bytes: to the transport directly when it takes them (see
            :func:`_asyncio_transport`), else through anyio."""
            direct = self._direct
            if direct is not None:
                transport, protocol = direct
                if protocol.write_event.is_set() and protocol.exception is None \
                        and not transport.is_closing():
                    transport.write(data)  # see _asyncio_transport
                    return
            await self._inner.write(data, timeout)

        async def _send_then_read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            self.read = self._inner.read  # type: ignore[method-assign]
            with contextlib.suppress(_WriteError):  # see the module's docstring
                await self._send(self._held.take(), self._held.timeout)
            data: bytes = await self._inner.read(max_bytes, timeout)
            return data

        async def aclose(self) -> None:
            await self._inner.aclose()

        async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                            timeout: float | None = None) -> Any:
            return _FastStream(await self._inner.start_tls(ssl_context, server_hostname, timeout),
                               self._sending)

        def get_extra_info(self, info: str) -> Any:
            if info == "is_readable":
                return _readable(self._sock)
            if info == "socket" and self._sock is not None:
                return self._sock
            return self._inner.get_extra_info(info)

    class _FastBackend(_Backend):  # type: ignore[misc, valid-type]
        """Wraps a backend so that the streams it connects are :class:`_FastStream`."""

        def __init__(self, inner: Any, sending: _Sending) -> None:
            self._inner = inner
            self._sending = sending

        async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                              local_address: str | None = None,
                              socket_options: Iterable[Any] | None = None) -> Any:
            return _FastStream(await self._inner.connect_tcp(
                host, port, timeout=timeout, local_address=local_address,
                socket_options=socket_options), self._sending)

        async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                      socket_options: Iterable[Any] | None = None) -> Any:
            return _FastStream(await self._inner.connect_unix_socket(
                path, timeout=timeout, socket_options=socket_options), self._sending)

        async def sleep(self, seconds: float) -> None:
            await self._inner.sleep(seconds)

    class _NotingStream(_SyncStreamBase):  # type: ignore[misc, valid-type]
        """A sync network stream that records the requests it sends and sends each in one
        write (the rest is the wrapped stream's)."""

        def __init__(self, inner: Any, sending: _Sending) -> None:
            self._inner = inner
            self._sending = sending
            self._held = _Held()
            self.read = inner.read  # type: ignore[method-assign]

        def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            data: bytes = self._inner.read(max_bytes, timeout)
            return data

        def write(self, buffer: bytes, timeout: float | None = None) -> None:
            _note(self._sending, self)
            if not buffer:
                return
            held, large = self._held.admit(buffer, timeout)
            if held is None and large is None:
                self.read = self._send_then_read  # type: ignore[method-assign]
                return
            self.read = self._inner.read  # type: ignore[method-assign]
            if held is not None:
                self._inner.write(held, self._held.timeout)
            if large is not None:
                self._inner.write(large, timeout)

        def _send_then_read(self, max_bytes: int, timeout: float | None = None) -> bytes:
            self.read = self._inner.read  # type: ignore[method-assign]
            with contextlib.suppress(_WriteError):  # see the module's docstring
                self._inner.write(self._held.take(), self._held.timeout)
            data: bytes = self._inner.read(max_bytes, timeout)
            return data

        def close(self) -> None:
            self._inner.close()

        def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                      timeout: float | None = None) -> Any:
            return _NotingStream(self._inner.start_tls(ssl_context, server_hostname, timeout),
                                 self._sending)

        def get_extra_info(self, info: str) -> Any:
            return self._inner.get_extra_info(info)

    class _NotingBackend(_SyncBackendBase):  # type: ignore[misc, valid-type]
        """Wraps a sync backend so that the streams it connects are :class:`_NotingStream`."""

        def __init__(self, inner: Any, sending: _Sending) -> None:
            self._inner = inner
            self._sending = sending

        def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                        local_address: str | None = None,
                        socket_options: Iterable[Any] | None = None) -> Any:
            return _NotingStream(self._inner.connect_tcp(
                host, port, timeout=timeout, local_address=local_address,
                socket_options=socket_options), self._sending)

        def connect_unix_socket(self, path: str, timeout: float | None = None,
                                socket_options: Iterable[Any] | None = None) -> Any:
            return _NotingStream(self._inner.connect_unix_socket(
                path, timeout=timeout, socket_options=socket_options), self._sending)

        def sleep(self, seconds: float) -> None:
            self._inner.sleep(seconds)


def _wrap_backend(transport: httpx2.AsyncHTTPTransport | httpx2.HTTPTransport,
                  sending: _Sending) -> None:
    """Wrap the transport's pool backend in :class:`_FastBackend` (async) or
    :class:`_NotingBackend` (sync), if it has the expected shape: httpx2 keeps the pool in
    ``_pool``, httpcore2 its backend in ``_network_backend``."""
    if _TYPES is None:  # pragma: no cover
        return
    pool = getattr(transport, "_pool", None)
    backend = getattr(pool, "_network_backend", None)
    if isinstance(backend, _Backend) and not isinstance(backend, _FastBackend):
        pool._network_backend = _FastBackend(backend, sending)  # type: ignore[union-attr]
    elif isinstance(backend, _SyncBackendBase) and not isinstance(backend, _NotingBackend):
        pool._network_backend = _NotingBackend(backend, sending)  # type: ignore[union-attr]


class _Origins:
    """Per-origin transports of one kind, and the TLS contexts they share."""

    def __init__(self, limits: httpx2.Limits) -> None:
        self._limits = limits
        self._tls: ssl.SSLContext | None = None
        self._unused_tls: ssl.SSLContext | None = None
        self._sending: _Sending = contextvars.ContextVar("zml_sending", default=None)

    def _verify(self, url: httpx2.URL) -> ssl.SSLContext:
        """The TLS context for a new pool to ``url``'s origin.

        Only https pools read it: an http pool gets a cheap one with no CA loaded (which would
        refuse every certificate), so a fleet of http nodes never loads the CA bundle.
        """
        if url.raw_scheme == b"https":
            if self._tls is None:
                self._tls = httpx2.create_ssl_context()
            return self._tls
        if self._unused_tls is None:
            self._unused_tls = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        return self._unused_tls


class SyncNodePools(_Origins, httpx2.BaseTransport):
    """The sync twin of :class:`NodePools`: one ``httpx2.HTTPTransport`` per origin.

    Args:
        limits: the limits of each pool (so ``max_connections`` is per node).
    """

    def __init__(self, limits: httpx2.Limits) -> None:
        super().__init__(limits)
        self._pools: dict[tuple[bytes, bytes, int | None], httpx2.HTTPTransport] = {}

    def _pool(self, url: httpx2.URL) -> httpx2.HTTPTransport:
        key = (url.raw_scheme, url.raw_host, url.port)
        pool = self._pools.get(key)
        if pool is None:
            made = httpx2.HTTPTransport(verify=self._verify(url), limits=self._limits)
            _wrap_backend(made, self._sending)
            pool = self._pools.setdefault(key, made)
        return pool

    def handle_request(self, request: httpx2.Request) -> httpx2.Response:
        """Send ``request`` on its origin's pool (its ``network_stream`` extension then says
        which connection it went out on)."""
        token = self._sending.set(request)
        try:
            return self._pool(request.url).handle_request(request)
        finally:
            self._sending.reset(token)

    def close(self) -> None:
        """Close every pool (and its connections)."""
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()


class NodePools(_Origins, httpx2.AsyncBaseTransport):
    """An httpx2 transport with one connection pool per origin (one per node).

    Args:
        limits: the limits of each pool (so ``max_connections`` is per node).
    """

    def __init__(self, limits: httpx2.Limits) -> None:
        from asyncio import get_running_loop  # not at import: the sync client never needs it

        super().__init__(limits)
        self._pools: dict[tuple[bytes, bytes, int | None], httpx2.AsyncHTTPTransport] = {}
        self._loop: object = None
        self._running_loop = get_running_loop

    def _moved(self, loop: object) -> None:
        """The first request on another event loop than the last one (a second
        ``asyncio.run()``): the pools' connections belong to the old loop, closed or not
        running here, and cannot be used from this one; new pools start empty (the old
        connections are let go of, and their sockets closed, with their loop's transports)."""
        self._pools = {}
        self._loop = loop

    def _pool(self, url: httpx2.URL) -> httpx2.AsyncHTTPTransport:
        key = (url.raw_scheme, url.raw_host, url.port)
        pool = self._pools.get(key)
        if pool is None:
            pool = httpx2.AsyncHTTPTransport(verify=self._verify(url), limits=self._limits)
            _wrap_backend(pool, self._sending)
            self._pools[key] = pool
        return pool

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        """Send ``request`` on its origin's pool (its ``network_stream`` extension then says
        which connection it went out on)."""
        loop = self._running_loop()
        if loop is not self._loop:
            self._moved(loop)
        token = self._sending.set(request)
        try:
            return await self._pool(request.url).handle_async_request(request)
        finally:
            self._sending.reset(token)

    async def aclose(self) -> None:
        """Close every pool (and its connections); those of another event loop than this one
        cannot be closed from here, and are let go of (see :meth:`_moved`)."""
        pools, self._pools = list(self._pools.values()), {}
        if self._running_loop() is not self._loop:
            self._loop = None
            return
        for pool in pools:
            await pool.aclose()
