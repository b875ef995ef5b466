"""HTTP to nodes: request bodies, failure mapping, and bounded reads of what nodes send.

Everything that can be written without I/O is (the body, the status-to-error map, the checks
of a completion's shape); the few functions that do I/O come in sync/async pairs of a few
lines, each bounded in size (and, through the caller's watch, in time). Streamed answers are
split and decoded by :mod:`zml.sse`.

Closing a streamed response closes its connection: that is the cancellation signal a node sees
(vLLM, SGLang and the simulated node drop the request when the client disconnects).
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Mapping
from datetime import timezone
from email.utils import parsedate_to_datetime
from typing import Any

import httpx2

from .errors import (
    ClientConfigError,
    NodeConnectionError,
    NodeError,
    NodeProtocolError,
    NodeTimeoutError,
    credentials,
    safe_detail,
    status_error,
)
from .node_urls import redact_url
from .validation import check_api_key, encode_json

__all__ = [
    "MAX_BODY_BYTES",
    "MAX_ERROR_BODY_BYTES",
    "MAX_JSON_DEPTH",
    "RETRY_AFTER_MAX_S",
    "PostRequests",
    "StreamDecoder",
    "aread_body",
    "aread_error_body",
    "auth_headers",
    "check_status",
    "completion_shape_problem",
    "completion_url",
    "decode_completion",
    "loads_limited",
    "map_transport_error",
    "read_body",
    "read_error_body",
    "retry_after_seconds",
    "safe_detail",
]

_JSON = "application/json"

MAX_BODY_BYTES = 16 * 1024 * 1024
"""The largest non-streamed response body zml reads from a node (16 MiB); more is refused."""
MAX_ERROR_BODY_BYTES = 64 * 1024
"""How much of an error response's body is kept (and parsed) for ``NodeStatusError.body``."""
MAX_JSON_DEPTH = 64
"""How deeply a node's JSON may nest (a chat completion needs about 6 levels)."""
RETRY_AFTER_MAX_S = 60.0
"""The longest Retry-After zml honours; a longer (or infinite) hint counts as this long."""


def completion_url(node_url: str) -> str:
    """The chat completions endpoint of a node whose base URL is ``node_url``."""
    return node_url + "/v1/chat/completions"


def auth_headers(api_key: str | None, *, param: str = "api_key") -> dict[str, str]:
    """Request headers; the API key travels only here, as a Bearer token.

    Raises:
        InvalidRequestError: the key cannot be sent in a header (see
            :func:`zml.validation.check_api_key`; ``param`` names where the key came from).
    """
    headers = {"content-type": _JSON, "accept": _JSON}
    key = check_api_key(api_key, param=param)
    if key:
        headers["authorization"] = f"Bearer {key}"
    return headers


def encode_body(body: Mapping[str, Any]) -> bytes:
    """The request body, serialised once per logical request (reused by every attempt).

    Raises:
        InvalidRequestError: a part of the body is not JSON (NaN, bytes, a lone surrogate...).
    """
    return encode_json(body)


class PostRequests:
    """Builds one client's POST requests to its nodes: what ``http.build_request`` builds, with
    the merged headers kept for each header dict that the client sends again and again.

    ``build_request`` merges the HTTP client's default headers with the request's on every
    call, and ``httpx2.Request(content=...)`` then looks each default header up again: 37-54
    us a request on this project's machine. A zml client sends the same few header dicts (its
    key's, each node's own) to the same nodes again and again, so their merge is kept per
    header dict and node, with the ``Host`` header ``Request`` would put first, and checked
    against the HTTP client's current defaults on each use; a request copies it and adds the
    body's ``Content-Length`` last, as ``Request`` does. What ``build_request`` would add
    beyond that goes through it: an HTTP client's cookies or query parameters, header dicts
    made for one request (``reuse=False``: a plugin's trace context), and a merge that sets
    ``Host`` or the body's length itself.
    """

    __slots__ = ("_http", "_merged")

    def __init__(self, http: httpx2.Client | httpx2.AsyncClient) -> None:
        self._http = http
        self._merged: dict[tuple[int, bytes], tuple[Mapping[str, str],
                                                    list[tuple[bytes, bytes]],
                                                    httpx2.Headers | None]] = {}

    def build(self, url: httpx2.URL, body: bytes, headers: Mapping[str, str],
              timeout: Mapping[str, float | None], *, reuse: bool) -> httpx2.Request:
        """The POST of ``body`` to ``url`` with ``headers`` and the ``timeout`` extension."""
        http = self._http
        if not reuse or http.cookies or http.params or url.is_relative_url:
            return http.build_request("POST", url, content=body, headers=headers,
                                      extensions={"timeout": timeout})
        defaults = http.headers.raw
        key = (id(headers), url.netloc)
        kept = self._merged.get(key)
        if kept is None or kept[0] is not headers or kept[1] != defaults:
            merged = httpx2.Headers(http.headers)
            merged.update(headers)
            head = None
            if not any(name in merged for name in _AUTO_HEADERS):
                head = httpx2.Headers([(b"Host", url.netloc), *merged.raw])
            kept = self._merged[key] = (headers, defaults, head)
        if kept[2] is None or not body:
            return http.build_request("POST", url, content=body, headers=headers,
                                      extensions={"timeout": timeout})
        request = httpx2.Request("POST", url, headers=kept[2], stream=httpx2.ByteStream(body),
                                 extensions={"timeout": timeout})
        request.headers["Content-Length"] = str(len(body))
        request.read()  # as Request(content=...) does: request.content is there to read
        return request


_AUTO_HEADERS = ("host", "content-length", "transfer-encoding")
"""Headers ``httpx2.Request`` adds to a request that does not set them."""


# --- failures -------------------------------------------------------------------------------

def map_transport_error(exc: httpx2.HTTPError, node_id: str) -> NodeError:
    """A typed zml error for an httpx2 transport failure on ``node_id``.

    Only failures of the node or the network map to a NodeError. A request the HTTP stack
    refuses to send (a malformed header: ``LocalProtocolError``, an unsupported URL scheme) is
    this client's fault: :class:`ClientConfigError` is *raised* here, so that no node is
    charged for it and no other node is tried. No message copies the exception's text when it
    may quote a header.

    Raises:
        ClientConfigError: the failure is on the client side.
    """
    name = type(exc).__name__
    if isinstance(exc, httpx2.LocalProtocolError | httpx2.UnsupportedProtocol):
        raise ClientConfigError(
            f"zml could not send the request to node {node_id!r}: the HTTP stack refused it "
            f"on this side ({name}); check the API key and any extra headers (values are not "
            "shown)",
            param="api_key" if isinstance(exc, httpx2.LocalProtocolError) else "url",
        ) from None
    if isinstance(exc, httpx2.TimeoutException):
        return NodeTimeoutError(f"node {node_id!r} timed out: {name}", node_id=node_id)
    detail = safe_detail(str(exc))
    if isinstance(exc, httpx2.TransportError):
        return NodeConnectionError(
            f"connection to node {node_id!r} failed: {name}" + (f": {detail}" if detail else ""),
            node_id=node_id,
        )
    return NodeProtocolError(
        f"node {node_id!r}: {name}" + (f": {detail}" if detail else ""), node_id=node_id
    )


def check_status(status: int, headers: httpx2.Headers, content: bytes, node_id: str,
                 sent: httpx2.Headers | None = None) -> None:
    """Raise the typed error for an HTTP error status or a redirect (``content``: the body;
    ``sent``: the request's headers, whose credential is kept out of the error, should the
    node echo it).

    A redirect is a :class:`NodeProtocolError` saying so: zml does not follow redirects (a
    POST must not be silently re-sent elsewhere, with or without its key).
    """
    if 300 <= status < 400:
        location = headers.get("location")
        where = f" to {safe_detail(redact_url(location))}" if location else ""
        raise NodeProtocolError(
            f"node {node_id!r} answered with a redirect (HTTP {status}{where}); zml does not "
            "follow redirects: set the node's url to the address that serves "
            "/v1/chat/completions",
            node_id=node_id,
        )
    if status < 400:
        return
    kept = content[:MAX_ERROR_BODY_BYTES]
    body: object
    try:
        body = _loads_bounded(kept) if kept else None
    except (ValueError, RecursionError):
        body = kept.decode(errors="replace")
    raise status_error(status, body, retry_after=_retry_after(headers), node_id=node_id,
                       secrets=credentials(sent))


def retry_after_seconds(headers: httpx2.Headers, *, now: float | None = None) -> float | None:
    """Seconds to wait before retrying, from ``retry-after-ms`` or ``Retry-After``.

    ``retry-after-ms`` (as OpenAI and vLLM-style servers send it) takes precedence over
    ``Retry-After``, which may be seconds or an HTTP date (``now``: the wall clock, default
    ``time.time()``). Read defensively: a negative value or a date in the past is 0; NaN or an
    unreadable value is no hint (None); anything longer than :data:`RETRY_AFTER_MAX_S`,
    infinity included, is that maximum. Dispatch also caps it at the request's deadline.
    """
    for name, scale in (("retry-after-ms", 1e-3), ("retry-after", 1.0)):
        value = headers.get(name)
        if value is None:
            continue
        seconds = _delay(value, scale, now)
        if seconds is not None:
            return min(seconds, RETRY_AFTER_MAX_S)
    return None


def _delay(value: str, scale: float, now: float | None) -> float | None:
    text = value.strip()
    try:
        number = float(text)
    except ValueError:
        number = None
    if number is not None and "_" not in text:
        if math.isnan(number):
            return None
        return max(0.0, number * scale) if math.isfinite(number) else (
            RETRY_AFTER_MAX_S if number > 0 else 0.0)
    if scale != 1.0:
        return None  # retry-after-ms is a number only
    try:
        when = parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    try:
        delta = when.timestamp() - (time.time() if now is None else now)
    except (OverflowError, OSError, ValueError):
        return None
    return max(0.0, delta)


def _retry_after(headers: httpx2.Headers) -> float | None:
    """:func:`retry_after_seconds` at the current time (the name check_status uses)."""
    return retry_after_seconds(headers)


# --- bodies ---------------------------------------------------------------------------------


def _too_large(node_id: str, size: int | str) -> NodeProtocolError:
    return NodeProtocolError(
        f"node {node_id!r} sent a response body of {size} bytes, more than zml reads "
        f"({MAX_BODY_BYTES:,} bytes, zml.transport.MAX_BODY_BYTES)",
        node_id=node_id,
    )


def _declared_length(response: httpx2.Response, node_id: str) -> None:
    declared = response.headers.get("content-length")
    if declared is not None and declared.strip().isdigit() and int(declared) > MAX_BODY_BYTES:
        raise _too_large(node_id, int(declared))


class _Body:
    """The parts of a body being read, within the size limit and the call's deadline."""

    __slots__ = ("clock", "deadline", "limit", "node_id", "parts", "size")

    def __init__(self, node_id: str, limit: int, deadline: float | None,
                 clock: Callable[[], float]) -> None:
        self.node_id = node_id
        self.limit = limit
        self.deadline = deadline
        self.clock = clock
        self.parts: list[bytes] = []
        self.size = 0

    def add(self, part: bytes) -> None:
        self.size += len(part)
        if self.size > self.limit:
            raise _too_large(self.node_id, f"more than {self.limit:,}")
        self.parts.append(part)
        if self.deadline is not None and self.clock() >= self.deadline:
            raise still_sending(self.node_id)


def still_sending(node_id: str) -> NodeTimeoutError:
    """The error for a body still arriving when its attempt's time was up: the request's
    deadline (dispatch then ends the request with its ``ZMLTimeoutError``), or sooner the
    attempt's own limit (dispatch then tries another node)."""
    return NodeTimeoutError(
        f"node {node_id!r} was still sending its answer when its time was up (the request's "
        "deadline, or the attempt's own limit: Timeouts.first_token, else its share of the "
        "time left when another node could answer)",
        node_id=node_id,
    )


def read_body(response: httpx2.Response, node_id: str, limit: int = MAX_BODY_BYTES, *,
              deadline: float | None = None,
              clock: Callable[[], float] = time.monotonic) -> bytes:
    """Read a streamed (``stream=True``) response's body, refusing more than ``limit`` bytes
    and stopping at ``deadline`` (on ``clock``), however the node paces its bytes.

    Raises:
        NodeProtocolError: the body is (or is declared) larger than the limit.
        NodeTimeoutError: the deadline passed while the body was still arriving.
        httpx2.HTTPError: a transport failure while reading (map it as usual).
    """
    _declared_length(response, node_id)
    body = _Body(node_id, limit, deadline, clock)
    for part in response.iter_bytes():
        body.add(part)
    return b"".join(body.parts)


async def aread_body(response: httpx2.Response, node_id: str, limit: int = MAX_BODY_BYTES, *,
                     deadline: float | None = None,
                     clock: Callable[[], float] = time.monotonic) -> bytes:
    """The async :func:`read_body`."""
    _declared_length(response, node_id)
    body = _Body(node_id, limit, deadline, clock)
    async for part in response.aiter_bytes():
        body.add(part)
    return b"".join(body.parts)


def read_error_body(response: httpx2.Response, limit: int = MAX_ERROR_BODY_BYTES) -> bytes:
    """The start of a streamed (``stream=True``) error response's body: at most ``limit``
    bytes, as kept for ``NodeStatusError.body``. The rest is never read: close the response
    (which drops its connection) afterwards."""
    parts: list[bytes] = []
    size = 0
    for part in response.iter_bytes():
        parts.append(part)
        size += len(part)
        if size >= limit:
            break
    return b"".join(parts)[:limit]


async def aread_error_body(response: httpx2.Response,
                           limit: int = MAX_ERROR_BODY_BYTES) -> bytes:
    """The async :func:`read_error_body`."""
    parts: list[bytes] = []
    size = 0
    async for part in response.aiter_bytes():
        parts.append(part)
        size += len(part)
        if size >= limit:
            break
    return b"".join(parts)[:limit]


def _depth_exceeds(data: object, limit: int) -> bool:
    stack: list[tuple[object, int]] = [(data, 1)]
    while stack:
        item, level = stack.pop()
        if isinstance(item, dict):
            if level > limit:
                return True
            stack.extend((v, level + 1) for v in item.values())
        elif isinstance(item, list):
            if level > limit:
                return True
            stack.extend((v, level + 1) for v in item)
    return False


def _brackets(data: bytes | str) -> int:
    if isinstance(data, str):
        return data.count("[") + data.count("{")
    return data.count(b"[") + data.count(b"{")


def _loads_bounded(data: bytes | str) -> Any:
    """json.loads, raising ValueError for nesting deeper than MAX_JSON_DEPTH."""
    value = json.loads(data)
    # JSON cannot nest deeper than it has brackets: counting them (in C) spares the walk for
    # every body of fewer than MAX_JSON_DEPTH (all answers but very large ones).
    if isinstance(value, dict | list) and _brackets(data) > MAX_JSON_DEPTH \
            and _depth_exceeds(value, MAX_JSON_DEPTH):
        raise RecursionError
    return value


def loads_limited(data: bytes | str, node_id: str, *, what: str = "a body") -> Any:
    """Parse a node's JSON, within :data:`MAX_JSON_DEPTH`; failures name the node.

    Raises:
        NodeProtocolError: not JSON (or not UTF-8), or nested too deeply.
    """
    # The errors are raised after the except blocks, so that no parser exception stays on them
    # as __context__ (a JSONDecodeError keeps the whole body, which may quote the key sent).
    try:
        return _loads_bounded(data)
    except RecursionError:
        deep = True
    except ValueError:
        deep = False
    if deep:
        raise NodeProtocolError(
            f"node {node_id!r} sent {what} whose JSON nests more than {MAX_JSON_DEPTH} levels "
            "deep (zml.transport.MAX_JSON_DEPTH)",
            node_id=node_id,
        )
    shown = data[:200] if isinstance(data, bytes) else data[:200].encode(errors="replace")
    raise NodeProtocolError(
        f"node {node_id!r} sent {what} that is not JSON: {safe_detail(repr(shown))}",
        node_id=node_id,
    )


def decode_completion(content: bytes, node_id: str) -> dict[str, Any]:
    """A non-streamed response body, checked to be a chat completion object.

    Raises:
        NodeProtocolError: too large, empty, not JSON, too deep, or not shaped like a chat
            completion; the message names the node and what was wrong.
    """
    if len(content) > MAX_BODY_BYTES:
        raise _too_large(node_id, len(content))
    if not content.strip():
        raise NodeProtocolError(
            f"node {node_id!r} answered with an empty body, not a chat completion",
            node_id=node_id,
        )
    data = loads_limited(content, node_id)
    problem = completion_shape_problem(data)
    if problem is not None:
        raise NodeProtocolError(
            f"node {node_id!r} returned a malformed chat completion: {problem}",
            node_id=node_id,
        )
    return data  # type: ignore[no-any-return]


_OPTIONAL_STR = (str, type(None))


def _kind(value: object) -> str:
    return "null" if value is None else {dict: "an object", list: "an array", str: "a string",
                                         bool: "a boolean"}.get(type(value), "a number")


def completion_shape_problem(data: object) -> str | None:
    """What is wrong with ``data`` as a chat completion object, or None if nothing is."""
    if not isinstance(data, dict):
        return f"the body is {_kind(data)}, not an object"
    choices = data.get("choices")
    if not isinstance(choices, list):
        return f"'choices' is {_kind(choices)}, not an array"
    for i, choice in enumerate(choices):
        where = f"choices[{i}]"
        if not isinstance(choice, dict):
            return f"{where} is {_kind(choice)}, not an object"
        message = choice.get("message")
        if not isinstance(message, dict):
            return f"{where}.message is {_kind(message)}, not an object"
        content = message.get("content")
        if not isinstance(content, _OPTIONAL_STR):
            return f"{where}.message.content is {_kind(content)}, not a string or null"
        tool_calls = message.get("tool_calls")
        if tool_calls is not None and not isinstance(tool_calls, list):
            return f"{where}.message.tool_calls is {_kind(tool_calls)}, not an array"
        if not isinstance(choice.get("finish_reason"), _OPTIONAL_STR):
            return f"{where}.finish_reason is {_kind(choice.get('finish_reason'))}, not a string"
    usage = data.get("usage")
    if usage is not None and not isinstance(usage, dict):
        return f"'usage' is {_kind(usage)}, not an object"
    return None


# The stream decoding moved to zml.sse (stream_error to zml.streaming); dispatch still
# imports StreamDecoder from here.
from .sse import StreamDecoder  # noqa: E402
