"""Serve simulated nodes on real loopback sockets, for end-to-end tests and `zml demo`.

Each node gets its own listening socket, bound when the fleet is built (so every URL is known
before anything runs) and served by uvicorn's HTTP protocol on one event loop: either the
caller's (`await fleet.serve()`) or a daemon thread's (`fleet.start()` / `stop()`).

uvicorn's protocol classes are driven directly on `loop.create_server` rather than through
`uvicorn.Server`, because failover tests need what a server process cannot give: `kill()`
closes one node's socket *and* its open connections at once (clients see connection refused
and cut streams, as after a crash), and `restart()` serves it again on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import threading
from collections.abc import Callable, Coroutine, Mapping, Sequence
from types import MappingProxyType, TracebackType
from typing import Any

import uvicorn
from uvicorn.server import ServerState

from zml.sim.node import SimNode, SimulatedDrop
from zml.sim.spec import SimNodeSpec

__all__ = ["SimFleet"]

_BACKLOG = 2048
_DRAIN_TIMEOUT_S = 2.0
_THREAD_TIMEOUT_S = 15.0


class _DropFilter(logging.Filter):
    """Silences uvicorn's error log for connections a node drops on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info
        return not (exc is not None and isinstance(exc[1], SimulatedDrop))


_DROP_FILTER = _DropFilter()


class _Listener:
    """One node's socket, asyncio server and uvicorn connection state."""

    __slots__ = ("config", "node", "port", "server", "sock", "state")

    def __init__(self, node: SimNode, port: int) -> None:
        self.node = node
        self.port = port
        self.sock: socket.socket | None = None
        self.server: asyncio.base_events.Server | None = None
        self.state: ServerState | None = None
        self.config: uvicorn.Config | None = None


class SimFleet:
    """Several `SimNode`s served over HTTP on loopback sockets.

    `ports` maps node ids to fixed ports; other nodes get a free port. Sockets are bound at
    construction (refusing connections until the fleet serves), so `url()` works at once.
    Use as a context manager, or `start()` / `stop()`, or `await serve()` in your own loop.
    """

    def __init__(
        self,
        specs: Sequence[SimNodeSpec],
        *,
        host: str = "127.0.0.1",
        ports: Mapping[str, int] | None = None,
        time_scale: float = 1.0,
    ) -> None:
        ports = dict(ports or {})
        ids = [spec.id for spec in specs]
        duplicates = sorted({i for i in ids if ids.count(i) > 1})
        if duplicates:
            raise ValueError(f"duplicate node ids: {duplicates}")
        unknown = sorted(set(ports) - set(ids))
        if unknown:
            raise ValueError(f"ports given for unknown node ids: {unknown}")
        self.host = host
        self._family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._nodes = {spec.id: SimNode(spec, time_scale=time_scale) for spec in specs}
        self.nodes: Mapping[str, SimNode] = MappingProxyType(self._nodes)
        """The nodes by id (their state and stats can be read from any thread)."""
        self._listeners = {i: _Listener(node, ports.get(i, 0)) for i, node in self._nodes.items()}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._stop_event: asyncio.Event | None = None
        self._thread: threading.Thread | None = None
        self._states: list[ServerState] = []
        self._pending: set[asyncio.Task[None]] = set()
        try:
            for listener in self._listeners.values():
                self._bind(listener)
        except OSError:
            self._close_sockets()
            raise

    # -- addresses ------------------------------------------------------------------------

    def url(self, node_id: str) -> str:
        """The base URL of a node, e.g. "http://127.0.0.1:8001"."""
        port = self._listener(node_id).port
        host = f"[{self.host}]" if self._family == socket.AF_INET6 else self.host
        return f"http://{host}:{port}"

    @property
    def urls(self) -> dict[str, str]:
        """Every node's base URL by node id."""
        return {node_id: self.url(node_id) for node_id in self._listeners}

    def _listener(self, node_id: str) -> _Listener:
        try:
            return self._listeners[node_id]
        except KeyError:
            raise KeyError(f"no simulated node {node_id!r}; nodes: {sorted(self._listeners)}") from None

    # -- lifecycle ------------------------------------------------------------------------

    def start(self) -> SimFleet:
        """Serve every node from a daemon thread; return once all sockets accept connections."""
        if self._thread is not None:
            return self
        if self._loop is not None:
            raise RuntimeError("this fleet is already serving in an event loop")
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            try:
                asyncio.run(self._serve(ready.set))
            except BaseException as exc:
                failure.append(exc)
                ready.set()

        self._thread = threading.Thread(target=run, name="zml-sim-fleet", daemon=True)
        self._thread.start()
        if not ready.wait(_THREAD_TIMEOUT_S) or failure:
            self.stop()
            if failure:
                raise RuntimeError("simulated fleet failed to start") from failure[0]
            raise RuntimeError("simulated fleet did not start in time")
        return self

    def stop(self) -> None:
        """Stop serving (open connections are closed) and release the sockets; idempotent."""
        loop, event = self._loop, self._stop_event
        if loop is not None and event is not None:
            if self._on_loop_thread():
                event.set()
            else:
                with contextlib.suppress(RuntimeError):
                    loop.call_soon_threadsafe(event.set)
        thread, self._thread = self._thread, None
        if thread is not None and thread is not threading.current_thread():
            thread.join(_THREAD_TIMEOUT_S)
        if self._loop is None:
            self._close_sockets()

    def __enter__(self) -> SimFleet:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    async def serve(self) -> None:
        """Serve every node in the running event loop until cancelled (or `stop()`)."""
        await self._serve(None)

    async def _serve(self, on_ready: Callable[[], None] | None) -> None:
        if self._loop is not None:
            raise RuntimeError("this fleet is already serving")
        uvicorn_log = logging.getLogger("uvicorn.error")
        uvicorn_log.addFilter(_DROP_FILTER)
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._stop_event = asyncio.Event()
        try:
            for listener in self._listeners.values():
                await self._open(listener)
            if on_ready is not None:
                on_ready()
            await self._stop_event.wait()
        finally:
            for listener in self._listeners.values():
                self._close(listener)
            await self._drain()
            self._loop = None
            self._loop_thread = None
            self._stop_event = None

    async def _drain(self) -> None:
        """Let the requests of closed connections finish aborting, then cancel stragglers."""
        pending = [*self._pending]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _DRAIN_TIMEOUT_S
        while loop.time() < deadline and any(state.tasks for state in self._states):
            await asyncio.sleep(0.005)
        for state in self._states:
            for task in list(state.tasks):
                task.cancel()
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        self._states.clear()

    # -- failover -------------------------------------------------------------------------

    def kill(self, node_id: str) -> None:
        """Stop serving a node like a crash: its socket and open connections close at once."""
        listener = self._listener(node_id)
        if self._on_loop_thread():
            self._close(listener)
        else:
            self._run_on_loop(self._async_close(listener))

    def restart(self, node_id: str) -> None:
        """Serve a node again on the same port (a node still serving is killed first)."""
        listener = self._listener(node_id)
        if self._on_loop_thread():
            self._close(listener)
            self._bind(listener)
            assert listener.sock is not None
            listener.sock.listen(_BACKLOG)
            task = asyncio.get_running_loop().create_task(self._open(listener))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)
        else:
            self._run_on_loop(self._async_reopen(listener))

    async def _async_close(self, listener: _Listener) -> None:
        self._close(listener)

    async def _async_reopen(self, listener: _Listener) -> None:
        self._close(listener)
        await self._open(listener)

    def _on_loop_thread(self) -> bool:
        return self._loop is not None and self._loop_thread == threading.get_ident()

    def _run_on_loop(self, coro: Coroutine[Any, Any, None]) -> None:
        loop = self._loop
        if loop is None:
            coro.close()
            raise RuntimeError("the simulated fleet is not serving")
        asyncio.run_coroutine_threadsafe(coro, loop).result(_THREAD_TIMEOUT_S)

    # -- sockets --------------------------------------------------------------------------

    def _bind(self, listener: _Listener) -> None:
        if listener.sock is not None:
            return
        # IPPROTO_TCP explicitly: asyncio sets TCP_NODELAY on accepted connections only when
        # the listening socket's proto says TCP (0 would leave Nagle on: 40 ms stalls).
        sock = socket.socket(self._family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((self.host, listener.port))
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        listener.sock = sock
        listener.port = sock.getsockname()[1]

    async def _open(self, listener: _Listener) -> None:
        self._bind(listener)
        sock = listener.sock
        assert sock is not None
        if listener.config is None:
            listener.config = uvicorn.Config(
                listener.node,
                host=self.host,
                port=listener.port,
                lifespan="off",
                interface="asgi3",
                ws="none",
                log_config=None,
                log_level="warning",
                access_log=False,
                proxy_headers=False,
                server_header=False,
                date_header=False,
                backlog=_BACKLOG,
            )
            listener.config.load()
        config = listener.config
        state = ServerState()
        protocol_class = config.http_protocol_class

        def factory() -> asyncio.Protocol:
            return protocol_class(config=config, server_state=state, app_state={})  # type: ignore[call-arg]

        listener.state = state
        self._states.append(state)
        listener.server = await asyncio.get_running_loop().create_server(factory, sock=sock, backlog=_BACKLOG)

    def _close(self, listener: _Listener) -> None:
        server, listener.server = listener.server, None
        if server is not None:
            server.close()
        sock, listener.sock = listener.sock, None
        if sock is not None:
            sock.close()
        state, listener.state = listener.state, None
        if state is not None:
            for connection in list(state.connections):
                transport = getattr(connection, "transport", None)
                if transport is not None:
                    transport.close()

    def _close_sockets(self) -> None:
        for listener in self._listeners.values():
            sock, listener.sock = listener.sock, None
            if sock is not None:
                sock.close()
