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

from .client import NOT_GIVEN, AsyncClient, Client, NotGiven
from .config import Registry
from .dispatch import Timeouts
from .errors import (
    AuthenticationError,
    BadRequestError,
    IncompleteStreamError,
    InternalServerError,
    InvalidRequestError,
    NodeConnectionError,
    NodeError,
    NodeProtocolError,
    NodeStatusError,
    NodeTimeoutError,
    NodeUnavailableError,
    NotFoundError,
    PolicyConfigError,
    RateLimitError,
    RoutingError,
    ZMLError,
    ZMLRoutingError,
    ZMLTimeoutError,
)
from .plugins.hookspecs import hookimpl
from .policy import Policy
from .streaming import AsyncStream, Stream
from .types import (
    Attempt,
    ChatCompletion,
    ChatCompletionChunk,
    Cost,
    RoutingInfo,
    Usage,
)

__version__ = "0.3.0"

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
    "Cost",
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
