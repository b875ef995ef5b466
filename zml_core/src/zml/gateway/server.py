"""``zml serve``: run the gateway app under uvicorn, in one process or several workers.

With one worker the app is built before the socket is bound, so a configuration error stops
the command at once with its message. With ``--workers N`` uvicorn starts N processes that
each build their own app (and client) from ``ZML_CONFIG``; the parent checks the
configuration first. Each worker keeps its own fleet state and metrics: to share node
capacity between workers or replicas, install zml-redis and set ``ZML_REDIS_URL``.

Connections are served by :class:`~zml.gateway.protocol.GatewayH11Protocol` (uvicorn's h11
protocol, not httptools): a request's head must arrive within ``[gateway] head_timeout_s`` and
hold at most :data:`~zml.gateway.protocol.MAX_HEAD_BYTES` (see :func:`connection_limits`).
"""

from __future__ import annotations

import contextlib
import errno
import functools
import inspect
import os
import socket
import sys
from collections.abc import Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette

from zml.config import ENV_CONFIG, discover_path, load_registry
from zml.errors import InvalidRequestError, PolicyConfigError

from .app import create_app
from .auth import KeyRing
from .protocol import MAX_HEAD_BYTES, GatewayH11Protocol
from .settings import GatewaySettings, gateway_settings

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "app_from_environment", "connection_limits", "serve"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8400


def max_workers() -> int:
    """The most ``--workers`` accepted: 4 per CPU (a typo such as 100000 would fork that many
    processes)."""
    return 4 * (os.cpu_count() or 1)


def connection_limits(settings: GatewaySettings) -> dict[str, Any]:
    """The uvicorn options that bound a connection's request head, in time and in size, how
    long a response may wait on a client that reads nothing, and how long a shutdown waits for
    the requests in flight.

    uvicorn's default protocol (httptools) bounds none of these: a client sending nothing, or a
    header byte now and then, kept its connection for ever, a header of 10 MB was read whole,
    and a client that stopped reading held its request (and a stream's node slot) for ever.
    h11's protocol has a size limit (a larger head gets 431); the gateway's subclass of it adds
    the time limits.
    """
    return {"http": functools.partial(GatewayH11Protocol, head_timeout_s=settings.head_timeout_s,
                                      send_timeout_s=settings.send_timeout_s),
            "h11_max_incomplete_event_size": MAX_HEAD_BYTES,
            "timeout_graceful_shutdown": settings.shutdown_timeout_s}


def app_from_environment() -> Starlette:
    """The app of one uvicorn worker (configuration from ``ZML_CONFIG``)."""
    return create_app()


def serve(config: str | None = None, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT,
          workers: int = 1, log_level: str = "info") -> int:
    """Serve the gateway until interrupted; returns the exit status.

    Raises:
        PolicyConfigError: the configuration is missing or invalid.
        InvalidRequestError: a bad port or worker count.
    """
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise InvalidRequestError(f"--workers must be a positive integer, got {workers!r}",
                                  param="workers")
    most = max_workers()
    if workers > most:
        raise InvalidRequestError(
            f"--workers {workers} is more than {most} (4 per CPU of this machine): each worker "
            "is a process with its own client; pass at most that many", param="workers")
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidRequestError(f"--port must be 0..65535, got {port!r}", param="port")
    if not isinstance(host, str) or not host.strip():
        raise InvalidRequestError(
            f"--host must be an address to listen on, got {host!r}: 127.0.0.1 (the default, "
            "this machine only), or 0.0.0.0 to listen on every interface on purpose",
            param="host")
    path = discover_path(config)
    if path is None:
        raise PolicyConfigError(
            "no zml.toml found: pass --config PATH, set ZML_CONFIG, or run where a zml.toml is",
            field="config",
        )
    if workers == 1:
        app = create_app(path)
        target: Starlette | str = app
        settings: GatewaySettings = app.state.gateway.settings
    else:
        registry = load_registry(path)
        settings = gateway_settings(registry)
        KeyRing.from_settings(settings, registry.source, os.environ)
        os.environ[ENV_CONFIG] = str(path.resolve())  # read by every worker's app
        target = "zml.gateway.server:app_from_environment"
    options: dict[str, Any] = {"log_level": log_level, "access_log": False, "lifespan": "on",
                               **connection_limits(settings)}
    with _listen(host, port) as sock:
        bound = sock.getsockname()[1]  # the real one for --port 0
        shown = f"[{host}]" if ":" in host else host
        print(f"zml gateway: serving {path} on http://{shown}:{bound}/v1"
              + (f" with {workers} workers" if workers > 1 else ""), file=sys.stderr)
        # Served on this very socket (an inet one: replies go out unbuffered), so the port
        # printed is the one served, with no moment where another process could take it.
        if workers == 1:
            server = uvicorn.Server(uvicorn.Config(target, **options))
            server.run(sockets=[sock])
            return 0 if server.started else 1
        _supervise(uvicorn.Config(target, host=host, port=bound, workers=workers, factory=True,
                                  **options), sock)
    return 0


def _supervise(config: uvicorn.Config, sock: socket.socket) -> None:
    """Run ``config.workers`` worker processes on ``sock`` under uvicorn's supervisor, as
    ``uvicorn.run`` does with a socket it binds itself (each worker inherits it)."""
    from uvicorn.supervisors import Multiprocess

    sock.set_inheritable(True)
    supervisor: Any = Multiprocess
    if "target" in inspect.signature(Multiprocess.__init__).parameters:  # older uvicorn
        supervisor = functools.partial(supervisor, target=uvicorn.Server(config).run)
    with contextlib.suppress(KeyboardInterrupt):
        supervisor(config, sockets=[sock]).run()


@contextlib.contextmanager
def _listen(host: str, port: int) -> Iterator[socket.socket]:
    """The gateway's listening socket, bound before anything is printed or started, so that a
    busy port (or an address this machine does not have) is one error naming it."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        why = "the port is already in use (another `zml serve`, or another server?)" \
            if exc.errno == errno.EADDRINUSE else (exc.strerror or str(exc))
        raise InvalidRequestError(
            f"cannot listen on {host}:{port}: {why}; pass another --port (or --host)",
            param="port",
        ) from None
    with sock:
        yield sock
