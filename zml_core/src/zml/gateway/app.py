"""The gateway's ASGI application: ``create_app(config)`` builds it, uvicorn serves it.

One :class:`zml.AsyncClient` per app does all routing, failover and accounting, exactly as in a
Python program; the app adds only what HTTP callers need: auth with gateway keys, the refusal
of web pages' requests (:mod:`zml.gateway.hosts`), the choice of policy from a header or an
alias, routing metadata in headers and bodies, OpenAI-shaped errors and Prometheus metrics.
Routes:

=============================  ===============================================================
``POST /v1/chat/completions``  chat completions, JSON or SSE (:mod:`zml.gateway.completions`)
``GET /v1/models``             the served models and the aliases (OpenAI's list shape)
``GET /health``                200 while the process is up
``GET /ready``                 200 when at least one node is viable, else 503
``GET /metrics``               Prometheus text (:mod:`zml.gateway.metrics`)
=============================  ===============================================================

``/v1/*`` need a gateway key when keys are configured; ``/health``, ``/ready`` and
``/metrics`` are for the operator's probes and scrapers and need none.

Everything an app holds lives on its :class:`Gateway` (no module-level state), so several
apps can run in one process, each with its own client, fleet state and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import httpx2
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from zml.client import AsyncClient
from zml.config import Registry, discover_path, load_registry
from zml.errors import PolicyConfigError, safe_detail
from zml.probe import health_says_up

from .auth import KeyRing
from .completions import AttemptLabels, ChatCompletions
from .errors import error_reply
from .hosts import HostCheckMiddleware
from .metrics import CONTENT_TYPE, GatewayMetrics
from .request_id import ForwardRequestId, RequestIdMiddleware
from .selection import Selector
from .settings import NODE_KEY_ENV, GatewaySettings, gateway_settings

__all__ = ["Gateway", "create_app"]

logger: logging.Logger = logging.getLogger("zml.gateway")

READY_TIMEOUT_S = 1.0
"""How long ``/ready`` waits for a node's ``/health``."""
READY_CACHE_S = 1.0
"""How long a ``/ready`` answer is reused (probes from many replicas stay cheap)."""


class Gateway:
    """Everything one gateway app holds: its client, settings, keys, selector and metrics."""

    def __init__(self, client: AsyncClient, settings: GatewaySettings, keys: KeyRing,
                 selector: Selector, source: str | None) -> None:
        self.client = client
        self.settings = settings
        self.keys = keys
        self.selector = selector
        self.source = source
        self.metrics: GatewayMetrics = GatewayMetrics(client.fleet.status)
        self.http: httpx2.AsyncClient | None = None
        self._ready: tuple[float, bool, list[dict[str, Any]]] | None = None

    async def readiness(self) -> tuple[bool, list[dict[str, Any]]]:
        """Whether at least one node answers ``/health`` and zml's fleet state does not count
        it out (circuit open), with each node's state."""
        now = time.monotonic()
        if self._ready is not None and now - self._ready[0] < READY_CACHE_S:
            return self._ready[1], self._ready[2]
        status = self.client.fleet.status()
        ups = await asyncio.gather(*(self._up(str(node["url"])) for node in status))
        nodes = [{"id": node["id"], "family": node["family"], "up": up,
                  "circuit": node["circuit"], "health": node["health"]}
                 for node, up in zip(status, ups, strict=True)]
        ready = any(n["up"] and n["circuit"] != "open" for n in nodes)
        self._ready = (now, ready, nodes)
        return ready, nodes

    async def _up(self, url: str) -> bool:
        """Whether the node's ``/health`` answers "up" within :data:`READY_TIMEOUT_S` in all
        (httpx2's timeout bounds each read, not a body trickled a byte at a time)."""
        http = self.http
        if http is None:
            return False
        try:
            status = await asyncio.wait_for(_health_status(http, url), READY_TIMEOUT_S)
        except (httpx2.HTTPError, asyncio.TimeoutError):
            return False
        return health_says_up(status)  # as zml's own prober reads it

    def authorized(self, request: Request) -> bool:
        """Whether a non-chat ``/v1`` request may proceed."""
        if not self.keys.enabled:
            return True
        given = request.headers.getlist("authorization")
        if len(given) > 1:  # two keys at once: which one a proxy in front checked is unknown
            return False
        return self.keys.authenticate(given[0].encode("latin-1") if given else None) \
            is not None


_HEALTH_BODY_MAX = 64 * 1024
"""The most of a ``/health`` body read (so its connection can be reused); a longer one is not
a health answer, and its connection is dropped."""


async def _health_status(http: httpx2.AsyncClient, url: str) -> int:
    async with http.stream("GET", f"{url}/health", timeout=READY_TIMEOUT_S) as response:
        read = 0
        async for part in response.aiter_raw():
            read += len(part)
            if read > _HEALTH_BODY_MAX:
                break
        return response.status_code


def _registry(config: str | os.PathLike[str] | Registry | None) -> Registry:
    if isinstance(config, Registry):
        return config
    path = discover_path(config)
    if path is None:
        raise PolicyConfigError(
            "no zml.toml found: pass --config PATH, set ZML_CONFIG, or run where a zml.toml is",
            field="config",
        )
    return load_registry(path)


def create_app(config: str | os.PathLike[str] | Registry | None = None, *,
               environ: Mapping[str, str] | None = None,
               probe_interval_s: float | None = 2.0) -> Starlette:
    """Build a gateway app over a ``zml.toml`` (path, Registry, or discovered as the SDK does).

    Args:
        config: the configuration; its ``[gateway]`` table configures the gateway.
        environ: where gateway keys (``api_keys_env``) and the node key (``ZML_API_KEY``) are
            read (default: ``os.environ``).
        probe_interval_s: passed to :class:`zml.AsyncClient` (node probes feed routing).

    Raises:
        PolicyConfigError: the configuration, its ``[gateway]`` table or a key file is invalid,
            or an alias, ``default_policy`` or a key file line names an unknown model or
            policy.
    """
    env = os.environ if environ is None else environ
    registry = _registry(config)
    settings = gateway_settings(registry)
    keys = KeyRing.from_settings(settings, registry.source, env)
    client = AsyncClient(env.get(NODE_KEY_ENV), config=registry,
                         probe_interval_s=probe_interval_s)
    client.plugins.register(ForwardRequestId(), name="zml-gateway-request-id")
    client.plugins.register(AttemptLabels(), name="zml-gateway-attempt-labels")
    served = {model for node in client.registry.nodes for model in node.models}
    if not served:  # what `zml policy check` refuses too: a gateway that can answer nothing
        raise PolicyConfigError(
            f"{registry.source or 'the configuration'} has no [[nodes]] (nor does any fleet-"
            "source plugin add one): the gateway would refuse every request; add the nodes "
            "it routes to (`zml demo --dir .` writes an example)",
            field="nodes", source=registry.source)
    selector = Selector(settings, served, client.policies)
    selector.check(registry.source)
    keys.check(client.policies, registry.source)
    gateway = Gateway(client, settings, keys, selector, registry.source)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        logger.info("zml gateway: %d nodes, %d policies, %s", len(client.registry.nodes),
                    len(client.policies),
                    f"{len(keys)} gateway keys" if keys.enabled else "no gateway keys (open)")
        async with httpx2.AsyncClient() as http:
            gateway.http = http
            try:
                yield
            finally:
                gateway.http = None
                await client.aclose()

    def model_entry(name: str, alias: tuple[str, str | None] | None) -> dict[str, Any]:
        entry: dict[str, Any] = {"id": name, "object": "model", "created": 0, "owned_by": "zml"}
        if alias is not None:
            entry["zml_alias"] = {"model": alias[0], "policy": alias[1]}
        return entry

    async def models(request: Request) -> Response:
        if not gateway.authorized(request):
            return _error(401, "a valid gateway API key is required", "invalid_api_key")
        data = [model_entry(name, alias) for name, alias in selector.models().items()]
        return JSONResponse({"object": "list", "data": data})

    async def model(request: Request) -> Response:
        if not gateway.authorized(request):
            return _error(401, "a valid gateway API key is required", "invalid_api_key")
        name = request.path_params["model_id"]
        known = selector.models()
        if name not in known:
            return _error(404, f"the model {safe_detail(name, 120)!r} does not exist on this "
                          "gateway: GET "
                          "/v1/models lists the served models and aliases", "model_not_found",
                          param="model")
        return JSONResponse(model_entry(name, known[name]))

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(request: Request) -> Response:
        ok, nodes = await gateway.readiness()
        return JSONResponse({"ready": ok, "nodes": nodes}, status_code=200 if ok else 503)

    async def metrics(request: Request) -> Response:
        return Response(gateway.metrics.render(), media_type=CONTENT_TYPE)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        if request.url.path.startswith("/v1/") and not gateway.authorized(request):
            # As every /v1 route answers: which paths exist is not for callers without a key.
            return _error(401, "a valid gateway API key is required", "invalid_api_key")
        code = "not_found" if exc.status_code == 404 else "method_not_allowed" \
            if exc.status_code == 405 else None
        return _error(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                      code, exc.headers)

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", ChatCompletions(gateway), methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", model, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/ready", ready, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
        ],
        lifespan=lifespan,
        exception_handlers={HTTPException: http_error},
        middleware=[Middleware(RequestIdMiddleware),
                    Middleware(HostCheckMiddleware, gateway=gateway)],
    )
    # A path with a trailing slash is a 404 like any unknown path, not a redirect: a client
    # that does not follow a POST's 307 (most do not) saw an empty reply with no error.
    app.router.redirect_slashes = False
    app.state.gateway = gateway
    return app


def _error(status: int, message: str, code: str | None,
           headers: Mapping[str, str] | None = None, *, param: str | None = None) -> Response:
    """An OpenAI-shaped error response, keeping ``headers`` (a 405's ``Allow``)."""
    reply = error_reply(status, message, "invalid_request_error", code=code, param=param)
    out = dict(headers or {})
    if status == 401:
        out["www-authenticate"] = "Bearer"
    return Response(reply.body(), status_code=status, media_type="application/json",
                    headers=out)
