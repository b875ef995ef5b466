"""Gateways on loopback: a simulated fleet, its zml.toml plus a ``[gateway]`` table, and the
gateway app served by uvicorn on a real socket in a background thread."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
import uvicorn

from tests.conftest import SimSetup
from zml.gateway.server import connection_limits

GATEWAY_KEY = "gw-test-key-6d1f0c"  # a gateway key (never a node key)
NODE_KEY = "node-secret-8a7c21"  # the nodes' key


@dataclass
class GatewayServer:
    """A gateway app served on a loopback socket, and the fleet behind it."""

    url: str
    app: Any
    setup: SimSetup
    environ: dict[str, str] = field(default_factory=dict)

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``.../v1``)."""
        return f"{self.url}/v1"

    @property
    def gateway(self) -> Any:
        return self.app.state.gateway

    def node(self, node_id: str) -> Any:
        return self.setup.node(node_id)


class _Thread:
    """uvicorn serving an app on an already-bound socket, from a daemon thread."""

    def __init__(self, app: Any) -> None:
        # IPPROTO_TCP named: asyncio sets TCP_NODELAY only on sockets that say they are TCP.
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port: int = self.sock.getsockname()[1]
        # A gateway app is served as ``zml serve`` serves it (its head limits, the h11 protocol).
        gateway = getattr(getattr(app, "state", None), "gateway", None)
        limits = connection_limits(gateway.settings) if gateway is not None else {}
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on",
                                **limits)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        asyncio.run(self.server.serve(sockets=[self.sock]))

    def start(self) -> _Thread:
        self.thread.start()
        deadline = time.monotonic() + 15
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()


@pytest.fixture
def serve_gateway(sim_fleet: Callable[..., SimSetup]) -> Iterator[Callable[..., GatewayServer]]:
    """Factory: a simulated fleet (``sim_fleet`` arguments) and a gateway over it.

    ``gateway`` is TOML text appended to the fleet's zml.toml (``[gateway]`` tables);
    ``environ`` is what the app reads keys from; ``node_key`` makes the nodes require a key.
    """
    from zml.gateway import create_app

    threads: list[_Thread] = []

    def make(nodes: Sequence[Mapping[str, Any]],
             policies: Mapping[str, Mapping[str, Any]] | None = None, *,
             gateway: str = "", families: Mapping[str, Mapping[str, Any]] | None = None,
             time_scale: float = 0.05, environ: Mapping[str, str] | None = None,
             node_key: str | None = None, extra_files: Mapping[str, str] | None = None,
             ) -> GatewayServer:
        setup = sim_fleet(nodes, policies, families, time_scale=time_scale, api_key=node_key)
        if gateway:
            setup.path.write_text(setup.path.read_text() + "\n" + gateway + "\n")
        for name, text in (extra_files or {}).items():
            (setup.path.parent / name).write_text(text)
        env = dict(environ or {})
        app = create_app(setup.path, environ=env, probe_interval_s=None)
        thread = _Thread(app).start()
        threads.append(thread)
        return GatewayServer(f"http://127.0.0.1:{thread.port}", app, setup, env)

    yield make
    for thread in threads:
        thread.stop()


def raw_exchange(gw: GatewayServer, request: bytes) -> tuple[bytes, bytes]:
    """Send ``request`` as it is, on a connection of its own, and read until the gateway closes
    it: (status line and headers, body). For what an HTTP client refuses to send (a stalled
    body, a length it will not send, whitespace around a header value)."""
    port = int(gw.url.rsplit(":", 1)[1])
    data = b""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:  # a safety net
        sock.sendall(request)
        while chunk := sock.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return head, body


def wait_for(predicate: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    """Poll until ``predicate()`` (the timeout is a safety net, not a measurement)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)
