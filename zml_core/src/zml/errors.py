"""Every error zml raises, in one tree.

A caller can catch ``zml.ZMLError`` for everything, or a branch of the tree for one kind of
failure. Errors that concern a node carry the routing metadata of the attempt that failed, so a
log line says where the request went::

    ZMLError
    ├── PolicyConfigError        a bad Policy, policy reference or zml.toml (raised at construction)
    ├── InvalidRequestError      a bad infer() argument, found before anything is sent
    │   └── ClientConfigError        the client cannot send at all (a bad header, key or URL)
    ├── RoutingError             no node could take the request (alias: ZMLRoutingError)
    ├── ZMLTimeoutError          the request's overall deadline expired (also a TimeoutError)
    └── NodeError                a node failed or answered with an error
        ├── NodeConnectionError      connection refused, reset or dropped
        ├── NodeTimeoutError         connect, first-token or idle timeout on one attempt
        ├── NodeProtocolError        the node broke the protocol (bad JSON, malformed SSE)
        │   └── IncompleteStreamError    a stream ended without [DONE] or its finish_reason(s)
        └── NodeStatusError          the node answered with an HTTP error status
            ├── BadRequestError          400, 422
            ├── AuthenticationError      401, 403
            ├── NotFoundError            404
            ├── RateLimitError           429 (retry_after)
            ├── NodeUnavailableError     502, 503, 504
            └── InternalServerError      500 and other 5xx

``retryable`` on a NodeError says whether dispatch may try another node for it (only before
the first token has reached the caller). ``node_fault`` says whether the failure was the node's
doing: only then may it touch the node's health and circuit. A :class:`ClientConfigError` is
never the node's fault and never retried: every node would fail the same way.

No message here copies text that can hold a header value or URL credentials.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .types import RoutingInfo

__all__ = [
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
]


class ZMLError(Exception):
    """Base class of every error raised by zml."""


class PolicyConfigError(ZMLError):
    """A policy, a policy reference or a ``zml.toml`` is invalid.

    Raised when a :class:`zml.Policy` is constructed, when a configuration file is loaded, or when
    ``infer(policy=...)`` names a policy that does not exist: never later as a RoutingError.

    Attributes:
        field: the field or key that is wrong (``accelerator_chain``, ``nodes[2].url``...), if known.
        value: the bad value, if known.
        suggestion: a close valid value ("did you mean ..."), if there is one.
        source: the file the bad value came from, if any.
    """

    def __init__(
        self,
        message: str,
        *,
        field: str | None = None,
        value: object = None,
        suggestion: str | None = None,
        source: str | None = None,
    ) -> None:
        super().__init__(message)
        self.field = field
        self.value = value
        self.suggestion = suggestion
        self.source = source


class InvalidRequestError(ZMLError, ValueError):
    """An ``infer`` argument is invalid (messages, model, an unknown parameter...).

    Raised before anything is sent to a node. ``param`` names the argument.
    """

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ClientConfigError(InvalidRequestError):
    """This client cannot send the request at all: the fault is on the calling side.

    For example an HTTP header the HTTP stack refuses (an API key with a line end or a
    non-ASCII character), or a URL it cannot use. Raised at once, without trying other nodes
    (every node would fail alike), and it leaves node health and circuits untouched.
    ``str(error)`` never contains the header's value.
    """

    retryable = False
    node_fault = False


class RoutingError(ZMLError):
    """No node could take the request under its policy.

    ``routing_context`` is a dict with (at least) these keys::

        {"policy": "llama3-production",
         "evaluated": [{"family": "H100", "nodes_checked": 3,
                        "rejected_reason": "all_nodes_over_capacity"}, ...],
         "final_error": "no_viable_node",
         "recommendation": "increase fleet capacity or enable queue_on_saturation"}

    ``str(error)`` includes the context as indented JSON, so logging the exception shows it.
    """

    def __init__(self, routing_context: dict[str, Any], message: str | None = None) -> None:
        self.routing_context = routing_context
        self.message: str = message or _routing_message(routing_context)
        super().__init__(self.message)

    def __str__(self) -> str:
        return f"{self.message}\nrouting_context = {json.dumps(self.routing_context, indent=2)}"


ZMLRoutingError = RoutingError
"""The 0.2 name of :class:`RoutingError`, kept as an alias."""


def _routing_message(context: dict[str, Any]) -> str:
    policy = context.get("policy")
    where = f"policy {policy!r}" if policy else "the request"
    final = context.get("final_error", "no_viable_node")
    hint = context.get("recommendation")
    text = f"routing failed for {where}: {final}"
    return f"{text} ({hint})" if hint else text


class ZMLTimeoutError(ZMLError, TimeoutError):
    """The request's overall deadline expired (while queued, in an attempt, or mid-stream).

    Attributes:
        routing: where the request was when time ran out, if it had been dispatched.
        text: for a stream, the content received before the deadline.
    """

    def __init__(
        self, message: str, *, routing: RoutingInfo | None = None, text: str = ""
    ) -> None:
        super().__init__(message)
        self.routing = routing
        self.text = text


class NodeError(ZMLError):
    """A node failed, or answered with an error.

    Attributes:
        node_id: the node that failed, when known.
        routing: the routing metadata of the failed attempt, when known.
        retryable: whether another node may be tried for this failure (before the first token).
        node_fault: whether the node caused it (only such failures lower its health and open
            its circuit; a fault of this client's own request or configuration does not).
    """

    retryable: bool = False
    node_fault: bool = True
    """Whether the node caused it: only such failures lower its health or open its circuit."""

    def __init__(
        self,
        message: str,
        *,
        node_id: str | None = None,
        routing: RoutingInfo | None = None,
    ) -> None:
        super().__init__(message)
        self.node_id = node_id
        self.routing = routing

    @property
    def kind(self) -> str:
        """A short stable name for the failure, used in ``routing.attempts``."""
        return _KINDS.get(type(self), "node_error")


class NodeConnectionError(NodeError):
    """The connection to a node was refused, reset or dropped."""

    retryable = True


class NodeTimeoutError(NodeError, TimeoutError):
    """One attempt timed out (connect, time to first token, or idle between chunks)."""

    retryable = True


class NodeProtocolError(NodeError):
    """The node broke the protocol: invalid JSON, a malformed SSE event, an unexpected shape."""


class IncompleteStreamError(NodeProtocolError):
    """A stream ended without ``data: [DONE]`` or a ``finish_reason`` (for every choice that
    appeared, when ``n`` > 1): never a silent short answer.

    Attributes:
        text: the content received before the stream broke off.
        chunks: how many chunks had been received.
    """

    def __init__(
        self,
        message: str,
        *,
        text: str = "",
        chunks: int = 0,
        node_id: str | None = None,
        routing: RoutingInfo | None = None,
    ) -> None:
        super().__init__(message, node_id=node_id, routing=routing)
        self.text = text
        self.chunks = chunks


class NodeStatusError(NodeError):
    """A node answered with an HTTP error status.

    Attributes:
        status_code: the HTTP status.
        body: the response body, decoded as JSON when possible (OpenAI error objects are).
    """

    def __init__(
        self,
        message: str,
        *,
        status_code: int,
        body: object = None,
        node_id: str | None = None,
        routing: RoutingInfo | None = None,
    ) -> None:
        super().__init__(message, node_id=node_id, routing=routing)
        self.status_code = status_code
        self.body = body


class BadRequestError(NodeStatusError):
    """The node rejected the request as invalid (400, 422). Never retried."""


class AuthenticationError(NodeStatusError):
    """The node rejected the API key (401, 403). Never retried."""


class NotFoundError(NodeStatusError):
    """The node does not serve the model or path (404). Never retried."""


class RateLimitError(NodeStatusError):
    """The node asked to slow down (429). ``retry_after`` is its Retry-After in seconds, if sent."""

    retryable = True

    def __init__(
        self,
        message: str,
        *,
        status_code: int = 429,
        body: object = None,
        retry_after: float | None = None,
        node_id: str | None = None,
        routing: RoutingInfo | None = None,
    ) -> None:
        super().__init__(
            message, status_code=status_code, body=body, node_id=node_id, routing=routing
        )
        self.retry_after = retry_after


class NodeUnavailableError(NodeStatusError):
    """The node or its gateway is unavailable or overloaded (502, 503, 504)."""

    retryable = True


class InternalServerError(NodeStatusError):
    """The node failed internally (500 and other 5xx). Retried within the bounded attempts."""

    retryable = True


_KINDS: dict[type[NodeError], str] = {
    NodeConnectionError: "connection_error",
    NodeTimeoutError: "timeout",
    NodeProtocolError: "protocol_error",
    IncompleteStreamError: "incomplete_stream",
    BadRequestError: "bad_request",
    AuthenticationError: "authentication_error",
    NotFoundError: "not_found",
    RateLimitError: "rate_limited",
    NodeUnavailableError: "unavailable",
    InternalServerError: "server_error",
}


def status_error(
    status_code: int, body: object, *, retry_after: float | None = None,
    node_id: str | None = None, secrets: tuple[str, ...] = ()
) -> NodeStatusError:
    """Map an HTTP error status from a node to its typed error (one place for the whole map).

    ``secrets``: what the request carried that must never be shown (its key): a node may echo
    it in its error body ("Incorrect API key provided: sk-..."), so it is taken out of the
    message and of ``body``, whatever the wording around it.
    """
    secrets = _forms(secrets)
    if secrets:
        body = _without(body, secrets)
    detail = _error_detail(body)
    where = f"node {node_id!r}" if node_id else "node"
    message = f"{where} answered HTTP {status_code}: {detail}"
    if status_code == 429:
        return RateLimitError(message, body=body, retry_after=retry_after, node_id=node_id)
    cls: type[NodeStatusError]
    if status_code in (400, 422):
        cls = BadRequestError
    elif status_code in (401, 403):
        cls = AuthenticationError
    elif status_code == 404:
        cls = NotFoundError
    elif status_code in (502, 503, 504):
        cls = NodeUnavailableError
    elif status_code >= 500:
        cls = InternalServerError
    else:
        cls = BadRequestError
    return cls(message, status_code=status_code, body=body, node_id=node_id)


def closed_client(kind: str, *, in_flight: bool = False) -> ClientConfigError:
    """The error of a call on a closed client (``kind``: "Client", "AsyncClient"), or of one
    still in flight when its client was closed: never a node's fault, never failed over."""
    if in_flight:
        closing = "aclose()" if kind.startswith("Async") else "close()"
        return ClientConfigError(
            f"this {kind} was closed ({closing} or the end of its `with` block) while the call "
            "was in flight: the call was stopped, no other node was tried and no node is "
            "blamed; close the client only after its calls have ended"
        )
    return ClientConfigError(
        f"this {kind} is closed: build a new one (or use it in a `with` block and send its "
        "requests inside the block)"
    )


CREDENTIAL_HEADERS = frozenset({
    "authorization", "proxy-authorization", "api-key", "x-api-key", "x-goog-api-key",
    "ocp-apim-subscription-key", "cookie",
})
"""Request headers whose values are credentials (lower case): ``Authorization`` (the client's
or a node's key), and those a plugin (``zml_request_headers``) or an ``http_client``'s default
headers may add, as Azure's ``api-key``."""


_CREDENTIAL_HEADER_BYTES = frozenset(name.encode() for name in CREDENTIAL_HEADERS)


def credentials(headers: Mapping[str, str] | None) -> tuple[str, ...]:
    """The credentials in ``headers`` (:data:`CREDENTIAL_HEADERS`): for ``Authorization``
    (``Bearer <key>``) the key, for the others the whole value; () when there are none."""
    if headers is None:
        return ()
    found: list[str] = []
    raw = getattr(headers, "raw", None)
    if isinstance(raw, list):
        # httpx2.Headers (what every request zml sends carries): read its bytes, and decode
        # only the credentials (its items() decodes every header, about 8 us a request here).
        encoding: str = getattr(headers, "encoding", "ascii")
        for name, value in raw:
            lowered_b = name.lower()
            if lowered_b in _CREDENTIAL_HEADER_BYTES and value:
                _add_credential(found, lowered_b.decode(), value.decode(encoding))
        return tuple(found)
    for name, value in headers.items():
        lowered = name.lower()
        if lowered in CREDENTIAL_HEADERS and value:
            _add_credential(found, lowered, value)
    return tuple(found)


def _add_credential(found: list[str], lowered: str, value: str) -> None:
    if lowered.endswith("authorization"):
        scheme, _, credential = value.partition(" ")
        found.append(credential.strip() or scheme)
    else:
        found.append(value)


def scrub(exc: BaseException, secrets: tuple[str, ...]) -> None:
    """Take ``secrets`` (the credentials an attempt sent) out of ``exc``, in place: its message,
    its ``body``, and the same in the exceptions chained to it.

    A node may quote the key it was sent anywhere (an error event in a stream, a body that is
    not JSON, a redirect's Location); dispatch scrubs every node error of an attempt with it,
    so that no path has to remember to.
    """
    secrets = _forms(secrets)
    seen: set[int] = set()
    current: BaseException | None = exc if secrets else None
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        current.args = tuple(_without(a, secrets) for a in current.args)
        if isinstance(current, NodeStatusError):
            current.body = _without(current.body, secrets)
        current = current.__cause__ or current.__context__


ANSWER_FIELDS = ("id", "model", "system_fingerprint")
"""The metadata of a node's answer (a completion or a stream's chunk) that zml passes on to
its caller (a gateway's callers too) and records in telemetry: what :func:`answer_scrubber`
redacts. The messages' content is the model's output, passed on as it came: never scrubbed."""


def answer_scrubber(secrets: tuple[str, ...]) -> Callable[[dict[str, Any]], None] | None:
    """For an attempt that sent ``secrets`` (its credentials): a function that takes them out
    of an answer's :data:`ANSWER_FIELDS` (a completion's decoded JSON, a chunk's fields), in
    place and as :func:`scrub` does (escaped, or cut short); None when nothing is worth it.

    A node may echo the key it was sent into a successful answer's ``id`` or ``model``.
    Dispatch binds one to the attempt that answered, and it runs on every chunk of a stream:
    where no secret is, it does one substring test per field (and quoted form) and allocates
    nothing.
    """
    forms = _forms(secrets)
    if not forms:
        return None
    heads = tuple(dict.fromkeys(form[:_KEPT] for form in forms))  # what _redact looks for

    def scrub_answer(fields: dict[str, Any]) -> None:
        for name in ANSWER_FIELDS:
            value = fields.get(name)
            if type(value) is str:
                for head in heads:
                    if head in value:
                        fields[name] = _without(value, forms)
                        break

    return scrub_answer


def _without(value: object, secrets: tuple[str, ...]) -> object:
    """``value`` (a node's decoded error body) with every occurrence of ``secrets`` (see
    :func:`_forms`) replaced."""
    if isinstance(value, str):
        for secret in secrets:
            value = _redact(value, secret)
        return value
    if isinstance(value, dict):
        return {_without(k, secrets): _without(v, secrets) for k, v in value.items()}
    if isinstance(value, list):
        return [_without(v, secrets) for v in value]
    return value


_KEPT = 8
"""The start of a secret this long is enough to redact it where a message cut it short."""


def _forms(secrets: tuple[str, ...]) -> tuple[str, ...]:
    """The ``secrets`` worth redacting (4 characters or more), each as it is and as a message
    may quote it: ``repr()`` of the text or of its bytes (a backslash doubled, a quote escaped)
    and JSON (a node's body, quoted)."""
    forms: dict[str, None] = {}
    for s in secrets:
        if len(s) >= 4:
            forms.update(dict.fromkeys(
                (s, repr(s)[1:-1], repr(s.encode())[2:-1], json.dumps(s)[1:-1])))
    return tuple(sorted(forms, key=len, reverse=True))  # a quoted form holds the plain one


def _redact(text: str, secret: str) -> str:
    """``text`` with ``secret`` replaced, also where it was cut short.

    A node's body is cut to a few hundred characters before it is quoted in a message, and a
    key may straddle the cut: so any run of the secret's first characters (at least
    :data:`_KEPT` of them, the whole secret when shorter) is taken out, however far it goes.
    """
    if len(secret) <= _KEPT:
        return text.replace(secret, "[redacted]")
    head = secret[:_KEPT]
    start = text.find(head)
    if start < 0:
        return text
    parts: list[str] = []
    done = 0
    while start >= 0:
        end = start + _KEPT
        while end < len(text) and end - start < len(secret) and text[end] == secret[end - start]:
            end += 1
        parts.append(text[done:start])
        parts.append("[redacted]")
        done = end
        start = text.find(head, end)
    parts.append(text[done:])
    return "".join(parts)


def _error_detail(body: object) -> str:
    if isinstance(body, dict):
        err = body.get("error", body)
        if isinstance(err, dict) and "message" in err:
            return safe_detail(str(err["message"]), 300)
        if isinstance(err, str):
            return safe_detail(err, 300)
    text = str(body) if body is not None else ""
    return safe_detail(text, 300) or "(no body)"


@functools.cache
def _secrets() -> tuple[tuple[re.Pattern[str], str], ...]:
    # Compiled on the first message that needs them, not at ``import zml`` (about 1 ms).
    return (
        (re.compile(r"(?i)\b(bearer|basic)\s+[^\s'\",;]+"), r"\1 [redacted]"),
        (re.compile(r"(?i)(authorization|api[-_]?key)(['\"]?\s*[:=]\s*(?:b(?=['\"]))?['\"]?)"
                    r"(?!(?:bearer|basic)\s)[^\s'\",;]+"), r"\1\2[redacted]"),
        (re.compile(r"(?i)\b([a-z][a-z0-9+.-]*://)[^/@\s]*@"), r"\1"),
    )


def safe_detail(text: str, limit: int = 200) -> str:
    """``text`` fit for an error message: credentials and header values removed, line ends
    flattened, at most ``limit`` characters.

    Used for every piece of text zml copies into a message from elsewhere (an exception of the
    HTTP stack, a node's error body, a redirect's Location).
    """
    for pattern, repl in _secrets():
        text = pattern.sub(repl, text)
    text = text.replace("\n", " ").replace("\r", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."
