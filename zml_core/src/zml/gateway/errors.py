"""zml's errors as OpenAI-shaped HTTP errors, so that every OpenAI client can read them.

Every error body is ``{"error": {"message", "type", "param", "code", ...}}``, as OpenAI's API
sends it; openai SDKs raise their usual exception classes from the status. The mapping, in
one place:

========================================  ======  =====================  ==========================
zml error                                 status  ``type``               ``code``
========================================  ======  =====================  ==========================
RoutingError, every attempt rate-limited  429     rate_limit_error       rate_limited
other RoutingError                        503     routing_error          its ``final_error``
InvalidRequestError, bad JSON, bad field  400     invalid_request_error  (``param`` named)
node BadRequestError (400, 422)           400     invalid_request_error  the node's code
node RateLimitError (429)                 429     rate_limit_error       rate_limited
node AuthenticationError (401, 403)       502     upstream_error         node_authentication_failed
ZMLTimeoutError (the overall deadline)    504     timeout_error          deadline_exceeded
NodeTimeoutError                          504     upstream_error         timeout
other NodeError                           502     upstream_error         its ``kind``
PolicyConfigError (a broken policy)       500     server_error           policy_config_error
anything else                             500     server_error           internal_error
========================================  ======  =====================  ==========================

A node's 429 is retried on other nodes (and on the same one after its ``Retry-After``) by the
client, so it reaches the gateway as a RoutingError ``attempts_exhausted`` whose ``__cause__``
is the last node's RateLimitError. When every failed attempt was a 429, the caller gets a 429
(openai SDKs then raise RateLimitError and back off) with ``routing_context`` in the body and
the last node's ``Retry-After`` in whole seconds, rounded up (at least 1; without one,
:data:`RETRY_AFTER_RATE_LIMIT_S`). A node's own 429 reaching the gateway directly gets the
same rounding.

Any other RoutingError's body also holds ``routing_context`` (the dict ``RoutingError``
carries), and it gets ``Retry-After`` when waiting may help: some node was full or queued,
tripped or unhealthy, or every attempt failed; not when no node serves the model. An error
that retrying cannot mend (a RoutingError without ``Retry-After``, a node's authentication
failure, a policy or internal error) carries ``x-should-retry: false``, which openai SDKs
honour: they raise at once instead of sending the request twice more. A node
error's body holds ``zml_routing`` when the failed attempt's routing is known. A node's
authentication failure never shows the node's answer (it may quote the key) nor any key.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from zml.errors import (
    AuthenticationError,
    BadRequestError,
    InvalidRequestError,
    NodeError,
    NodeTimeoutError,
    PolicyConfigError,
    RateLimitError,
    RoutingError,
    ZMLTimeoutError,
)

from .request_id import CURRENT

__all__ = ["ErrorReply", "error_reply", "invalid_request", "reply_for"]

logger: logging.Logger = logging.getLogger("zml.gateway")

Headers = Sequence[tuple[bytes, bytes]]

RETRY_AFTER_CAPACITY_S = 1
"""Retry-After when nodes were full or the saturation queue was: slots free up in seconds."""
RETRY_AFTER_HEALTH_S = 10
"""Retry-After when nodes were failing (circuit open, unhealthy, every attempt failed): the
circuit breaker's cooldown."""

RETRY_AFTER_RATE_LIMIT_S = 1
"""Retry-After of a 429 whose node sent none."""

_CAPACITY_REASONS = frozenset({"all_nodes_over_capacity", "latency_target_exceeded"})
_HEALTH_REASONS = frozenset({"circuit_open", "health_score_below_threshold",
                             "excluded_after_failure"})


@dataclass(frozen=True)
class ErrorReply:
    """An error response: status, the JSON body's ``error`` object, extra headers."""

    status: int
    error: Mapping[str, Any]
    headers: Headers = ()
    outcome: str = "error"
    """The ``outcome`` label of the request metrics."""

    def body(self) -> bytes:
        """The response body (JSON)."""
        return json.dumps({"error": self.error}, separators=(",", ":"),
                          ensure_ascii=False).encode()

    def sse_event(self) -> bytes:
        """The same error as the last event of an SSE stream (openai SDKs raise on it)."""
        return b"data: " + self.body() + b"\n\n"


NO_RETRY: Headers = ((b"x-should-retry", b"false"),)
"""Sent with an error that retrying cannot mend (openai SDKs honour it and do not retry)."""


def error_reply(status: int, message: str, type_: str, *, code: str | None = None,
                param: str | None = None, headers: Headers = (), outcome: str = "error",
                **extra: Any) -> ErrorReply:
    """An OpenAI-shaped error."""
    error: dict[str, Any] = {"message": message, "type": type_, "param": param, "code": code}
    error.update(extra)
    return ErrorReply(status, error, headers, outcome)


def invalid_request(message: str, param: str | None = None, code: str | None = None,
                    status: int = 400) -> ErrorReply:
    """A 400 (or ``status``) ``invalid_request_error`` naming the bad ``param``."""
    return error_reply(status, message, "invalid_request_error", code=code, param=param,
                       outcome="invalid_request")


def reply_for(exc: BaseException) -> ErrorReply:
    """The HTTP error for an exception raised by ``infer`` / ``infer_stream``."""
    if isinstance(exc, RoutingError):
        return _routing(exc)
    if isinstance(exc, InvalidRequestError):
        return invalid_request(str(exc), exc.param)
    if isinstance(exc, ZMLTimeoutError):
        return error_reply(504, str(exc), "timeout_error", code="deadline_exceeded",
                           outcome="timeout", **_routing_extra(exc.routing))
    if isinstance(exc, NodeError):
        return _node(exc)
    if isinstance(exc, PolicyConfigError):
        return error_reply(500, str(exc), "server_error", code="policy_config_error",
                           param=exc.field, headers=NO_RETRY)
    rid = CURRENT.get()
    logger.error("zml gateway: unexpected error (request %s)", rid, exc_info=exc)
    return error_reply(500, f"internal gateway error (request {rid}: see the gateway's log)",
                       "server_error", code="internal_error", headers=NO_RETRY)


def _routing(exc: RoutingError) -> ErrorReply:
    context = exc.routing_context
    if _rate_limited(context):
        cause = exc.__cause__
        after = cause.retry_after if isinstance(cause, RateLimitError) else None
        return error_reply(
            429, exc.message, "rate_limit_error", code="rate_limited",
            headers=[(b"retry-after", _seconds(after))], outcome="routing_error",
            routing_context=context)
    # Without Retry-After, waiting would not help (no node serves the model, every family is
    # excluded...): the caller's SDK is told not to retry.
    after = retry_after(context)
    headers = NO_RETRY if after is None else ((b"retry-after", str(after).encode()),)
    return error_reply(503, exc.message, "routing_error", code=context.get("final_error"),
                       headers=headers, outcome="routing_error", routing_context=context)


def retry_after(context: Mapping[str, Any]) -> int | None:
    """Seconds after which capacity may be back, from a routing context; None: it will not
    come back by waiting (e.g. no node serves the model)."""
    final = context.get("final_error")
    if final in ("queue_full", "queue_timeout"):
        return RETRY_AFTER_CAPACITY_S
    if final == "attempts_exhausted":
        return RETRY_AFTER_HEALTH_S
    reasons = {e.get("rejected_reason") for e in context.get("evaluated") or ()
               if isinstance(e, Mapping)}
    if reasons & _CAPACITY_REASONS:
        return RETRY_AFTER_CAPACITY_S
    if reasons & _HEALTH_REASONS:
        return RETRY_AFTER_HEALTH_S
    return None


def _rate_limited(context: Mapping[str, Any]) -> bool:
    """Whether every failed attempt of an ``attempts_exhausted`` was a node's 429."""
    attempts = context.get("attempts")
    return context.get("final_error") == "attempts_exhausted" \
        and isinstance(attempts, list) and bool(attempts) \
        and all(isinstance(a, Mapping) and a.get("error") == "rate_limited" for a in attempts)


def _seconds(value: float | None) -> bytes:
    """A ``Retry-After`` value: ``value`` rounded up to whole seconds, at least 1."""
    if value is None or not math.isfinite(value):
        return str(RETRY_AFTER_RATE_LIMIT_S).encode()
    return str(max(1, math.ceil(value))).encode()


def _routing_extra(routing: Any) -> dict[str, Any]:
    return {} if routing is None else {"zml_routing": routing.model_dump(mode="json")}


def _node(exc: NodeError) -> ErrorReply:
    extra = _routing_extra(exc.routing)
    node = f"node {exc.node_id!r}" if exc.node_id else "a node"
    if isinstance(exc, AuthenticationError):
        return error_reply(
            502,
            f"{node} rejected the gateway's node credentials (HTTP {exc.status_code}); the "
            "gateway's operator must check the node API key it sends (ZML_API_KEY)",
            "upstream_error", code="node_authentication_failed", outcome="node_error",
            headers=NO_RETRY, **extra)
    if isinstance(exc, BadRequestError):
        param, code = _node_fields(exc.body)
        return error_reply(400, str(exc), "invalid_request_error", code=code, param=param,
                           outcome="invalid_request", **extra)
    if isinstance(exc, RateLimitError):
        headers = [] if exc.retry_after is None else [(b"retry-after", _seconds(exc.retry_after))]
        return error_reply(429, str(exc), "rate_limit_error", code="rate_limited",
                           headers=headers, outcome="node_error", **extra)
    status = 504 if isinstance(exc, NodeTimeoutError) else 502
    return error_reply(status, str(exc), "upstream_error", code=exc.kind, outcome="node_error",
                       **extra)


def _node_fields(body: object) -> tuple[str | None, str | None]:
    """The ``param`` and ``code`` of a node's 400: OpenAI's ``{"error": {...}}``, or the fields
    at the top, as vLLM's ``{"object": "error", "message": ...}`` has them."""
    if not isinstance(body, dict):
        return None, None
    err = body.get("error", body)
    if not isinstance(err, dict):
        return None, None
    param, code = err.get("param"), err.get("code")
    return (param if isinstance(param, str) else None,
            code if isinstance(code, str) else None)
