"""The zml gateway (``zml serve``): zml's routing over HTTP, for callers in any language.

An OpenAI-compatible endpoint over the same :class:`zml.AsyncClient` core: clients that speak
only the OpenAI API (the openai SDKs, curl, IDE assistants) get policies chosen by header,
alias or default, the routing metadata in ``x-zml-*`` headers and ``zml_routing``, and the
routing context in OpenAI-shaped errors. See ``docs/gateway.md``.

``create_app(config)`` returns the ASGI app (to serve with any ASGI server);
``serve(config, host=..., port=..., workers=...)`` runs it under uvicorn.
"""

from __future__ import annotations

from .app import Gateway, create_app
from .server import serve
from .settings import Alias, GatewaySettings

__all__ = ["Alias", "Gateway", "GatewaySettings", "create_app", "serve"]
