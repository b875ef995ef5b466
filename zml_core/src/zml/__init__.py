"""zml: route chat completions across an inference fleet by accelerator family.

Routing policy lives in configuration (``zml.toml`` or a plugin's store), not in application
code::

    import zml

    client = zml.Client(api_key="...")
    response = client.infer(
        model="meta-llama/llama-3-8b-instruct",
        messages=[{"role": "user", "content": "Hello"}],
        policy="llama3-production",          # a [policies.NAME] table of zml.toml
    )
    response.routing.node_id, response.routing.accelerator

The public names are listed in ``__all__``; modules are importable but their other names are
not part of the stable API.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.3.0"

# Public name -> the module that defines it. Names load on first access (PEP 562), so that
# `import zml` stays cheap: no pydantic models, HTTP stack or plugins until they are used.
_EXPORTS: dict[str, str] = {
    "NOT_GIVEN": "client_base",
    "AsyncClient": "client",
    "Client": "client",
    "NotGiven": "client_base",
    "LoopClients": "adapters",
    "Registry": "config",
    "Timeouts": "dispatch",
    "Policy": "policy",
    "AsyncStream": "streaming",
    "Stream": "streaming",
    "Attempt": "types",
    "ChatCompletion": "types",
    "ChatCompletionChunk": "types",
    "Cost": "types",
    "RoutingInfo": "types",
    "Usage": "types",
    "hookimpl": "plugins.hookspecs",
    **{
        name: "errors"
        for name in (
            "AuthenticationError",
            "BadRequestError",
            "ClientConfigError",
            "IncompleteStreamError",
            "InternalServerError",
            "InvalidRequestError",
            "NodeConnectionError",
            "NodeError",
            "NodeProtocolError",
            "NodeStatusError",
            "NodeTimeoutError",
            "NodeUnavailableError",
            "NotFoundError",
            "PolicyConfigError",
            "RateLimitError",
            "RoutingError",
            "ZMLError",
            "ZMLRoutingError",
            "ZMLTimeoutError",
        )
    },
}

__all__ = [
    "NOT_GIVEN",
    "AsyncClient",
    "AsyncStream",
    "Attempt",
    "AuthenticationError",
    "BadRequestError",
    "ChatCompletion",
    "ChatCompletionChunk",
    "Client",
    "ClientConfigError",
    "Cost",
    "IncompleteStreamError",
    "InternalServerError",
    "InvalidRequestError",
    "LoopClients",
    "NodeConnectionError",
    "NodeError",
    "NodeProtocolError",
    "NodeStatusError",
    "NodeTimeoutError",
    "NodeUnavailableError",
    "NotFoundError",
    "NotGiven",
    "Policy",
    "PolicyConfigError",
    "RateLimitError",
    "Registry",
    "RoutingError",
    "RoutingInfo",
    "Stream",
    "Timeouts",
    "Usage",
    "ZMLError",
    "ZMLRoutingError",
    "ZMLTimeoutError",
    "__version__",
    "hookimpl",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'zml' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"zml.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:
    from .adapters import LoopClients as LoopClients
    from .client import AsyncClient as AsyncClient, Client as Client
    from .client_base import NOT_GIVEN as NOT_GIVEN, NotGiven as NotGiven
    from .config import Registry as Registry
    from .dispatch import Timeouts as Timeouts
    from .errors import (
        AuthenticationError as AuthenticationError,
        BadRequestError as BadRequestError,
        ClientConfigError as ClientConfigError,
        IncompleteStreamError as IncompleteStreamError,
        InternalServerError as InternalServerError,
        InvalidRequestError as InvalidRequestError,
        NodeConnectionError as NodeConnectionError,
        NodeError as NodeError,
        NodeProtocolError as NodeProtocolError,
        NodeStatusError as NodeStatusError,
        NodeTimeoutError as NodeTimeoutError,
        NodeUnavailableError as NodeUnavailableError,
        NotFoundError as NotFoundError,
        PolicyConfigError as PolicyConfigError,
        RateLimitError as RateLimitError,
        RoutingError as RoutingError,
        ZMLError as ZMLError,
        ZMLRoutingError as ZMLRoutingError,
        ZMLTimeoutError as ZMLTimeoutError,
    )
    from .plugins.hookspecs import hookimpl as hookimpl
    from .policy import Policy as Policy
    from .streaming import AsyncStream as AsyncStream, Stream as Stream
    from .types import (
        Attempt as Attempt,
        ChatCompletion as ChatCompletion,
        ChatCompletionChunk as ChatCompletionChunk,
        Cost as Cost,
        RoutingInfo as RoutingInfo,
        Usage as Usage,
    )
