"""``zml serve``: run the gateway app under uvicorn, in one process or several workers.

With one worker the app is built before the socket is bound, so a configuration error stops
the command at once with its message. With ``--workers N`` uvicorn starts N processes that
each build their own app (and client) from ``ZML_CONFIG``; the parent checks the
configuration first. Each worker keeps its own fleet state and metrics: to share node
capacity between workers or replicas, install zml-redis and set ``ZML_REDIS_URL``.
"""

from __future__ import annotations

import os
import sys

import uvicorn
from starlette.applications import Starlette

from zml.config import ENV_CONFIG, discover_path, load_registry
from zml.errors import InvalidRequestError, PolicyConfigError

from .app import create_app
from .auth import KeyRing
from .settings import gateway_settings

__all__ = ["DEFAULT_HOST", "DEFAULT_PORT", "app_from_environment", "serve"]

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8400


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
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidRequestError(f"--port must be 0..65535, got {port!r}", param="port")
    path = discover_path(config)
    if path is None:
        raise PolicyConfigError(
            "no zml.toml found: pass --config PATH, set ZML_CONFIG, or run where a zml.toml is",
            field="config",
        )
    common: dict[str, object] = {"host": host, "port": port, "log_level": log_level,
                                 "access_log": False, "lifespan": "on"}
    if workers == 1:
        app = create_app(path)
        print(f"zml gateway: serving {path} on http://{host}:{port}/v1", file=sys.stderr)
        uvicorn.run(app, **common)  # type: ignore[arg-type]
        return 0
    registry = load_registry(path)
    KeyRing.from_settings(gateway_settings(registry), registry.source, os.environ)
    os.environ[ENV_CONFIG] = str(path.resolve())  # read by every worker's app
    print(f"zml gateway: serving {path} on http://{host}:{port}/v1 with {workers} workers",
          file=sys.stderr)
    uvicorn.run("zml.gateway.server:app_from_environment", factory=True, workers=workers,
                **common)  # type: ignore[arg-type]
    return 0
