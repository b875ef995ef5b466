"""HTTP to nodes: request building, failure mapping, and stream decoding.

Everything that can be written without I/O is (the body and headers, the status-to-error map,
:class:`StreamDecoder`); the few functions that do I/O come in sync/async pairs of a few lines.
SSE framing is parsed by httpx2's maintained ``EventSource``; what the events mean (chunks,
``[DONE]``, integrity) is decided here, once.

Closing a streamed response closes its connection: that is the cancellation signal a node sees
(vLLM, SGLang and the simulated node drop the request when the client disconnects).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import httpx2

from .errors import (
    NodeConnectionError,
    NodeError,
    NodeProtocolError,
    NodeTimeoutError,
    status_error,
)

__all__ = [
    "StreamDecoder",
    "auth_headers",
    "check_status",
    "completion_url",
    "decode_completion",
    "map_transport_error",
]

_JSON = "application/json"


def completion_url(node_url: str) -> str:
    """The chat completions endpoint of a node whose base URL is ``node_url``."""
    return node_url + "/v1/chat/completions"


def auth_headers(api_key: str | None) -> dict[str, str]:
    """Request headers; the API key travels only here, as a Bearer token."""
    headers = {"content-type": _JSON, "accept": _JSON}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    return headers


def encode_body(body: Mapping[str, Any]) -> bytes:
    """The request body, serialised once per logical request (reused by every attempt)."""
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def map_transport_error(exc: httpx2.HTTPError, node_id: str) -> NodeError:
    """A typed zml error for an httpx2 transport failure on ``node_id``."""
    if isinstance(exc, httpx2.TimeoutException):
        return NodeTimeoutError(f"node {node_id!r} timed out: {type(exc).__name__}", node_id=node_id)
    if isinstance(exc, httpx2.TransportError):
        return NodeConnectionError(
            f"connection to node {node_id!r} failed: {type(exc).__name__}: {exc}", node_id=node_id
        )
    return NodeProtocolError(f"node {node_id!r}: {type(exc).__name__}: {exc}", node_id=node_id)


def check_status(status: int, headers: httpx2.Headers, content: bytes, node_id: str) -> None:
    """Raise the typed error for an HTTP error status (``content`` is the read body)."""
    if status < 400:
        return
    body: object
    try:
        body = json.loads(content) if content else None
    except ValueError:
        body = content.decode(errors="replace")
    raise status_error(status, body, retry_after=_retry_after(headers), node_id=node_id)


def _retry_after(headers: httpx2.Headers) -> float | None:
    """Seconds to wait before retrying: ``retry-after-ms`` (as OpenAI and vLLM-style servers
    send it) takes precedence over ``Retry-After`` in seconds; an HTTP date is no hint."""
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        try:
            return max(0.0, float(value) * scale)
        except ValueError:
            continue
    return None


def decode_completion(content: bytes, node_id: str) -> dict[str, Any]:
    """A non-streamed response body, checked to be a chat completion object."""
    try:
        data = json.loads(content)
    except ValueError:
        raise NodeProtocolError(
            f"node {node_id!r} returned a body that is not JSON: {content[:200]!r}", node_id=node_id
        ) from None
    if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
        raise NodeProtocolError(
            f"node {node_id!r} returned JSON that is not a chat completion: {str(data)[:200]}",
            node_id=node_id,
        )
    return data


# The stream decoding moved to zml.sse (stream_error to zml.streaming); dispatch still
# imports StreamDecoder from here.
from .sse import StreamDecoder  # noqa: E402
