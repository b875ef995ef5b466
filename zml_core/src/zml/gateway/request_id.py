"""``x-request-id`` on every gateway response, as OpenAI's API sends it.

The openai SDKs read it (``response._request_id`` in Python, ``response.request_id`` in
Node.js) so that a caller can quote one id when it reports a problem, and the gateway's log
lines about that request carry the same id. A caller (or a proxy in front) may send its own
``x-request-id``: it is kept when it is a plausible id (1 to 128 characters of letters,
digits and ``-_.:``), so that one id follows the request through every hop; anything else is
replaced by a fresh ``req_<32 hex digits>``.

The id is also this request's context (:data:`CURRENT`, a context variable, which the
request's task and the zml call it makes share): the gateway's log line for an unexpected
error names it, and the gateway's client sends it on to the node as ``x-request-id`` (vLLM's
``--enable-request-id-headers`` then takes it as its own request id), so one id ties the
caller's report, the gateway's log and the node's log together.

A pure ASGI middleware (no Starlette request objects), so it costs one header read and one
header added per request.
"""

from __future__ import annotations

import contextvars
import re
import uuid
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import zml

__all__ = ["CURRENT", "HEADER", "ForwardRequestId", "RequestIdMiddleware"]

HEADER = "x-request-id"
_RAW = HEADER.encode()
_PLAUSIBLE = re.compile(rb"[A-Za-z0-9._:\-]{1,128}")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


CURRENT: contextvars.ContextVar[str | None] = contextvars.ContextVar("zml_gateway_request_id",
                                                                      default=None)
"""The id of the request being served (None outside a request)."""


class RequestIdMiddleware:
    """Give every HTTP request an id (the caller's, when plausible) and send it back as
    ``x-request-id``; the request's code reads it from :data:`CURRENT`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == _RAW), None)
        if given is not None and _PLAUSIBLE.fullmatch(given):
            rid = given.decode()
        else:
            rid = f"req_{uuid.uuid4().hex}"
        raw = rid.encode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ()) if k != _RAW]
                headers.append((_RAW, raw))
                message["headers"] = headers
            await send(message)

        token = CURRENT.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            CURRENT.reset(token)


class ForwardRequestId:
    """A plugin of the gateway's own client: every attempt carries the gateway request's id
    to the node as ``x-request-id``."""

    @zml.hookimpl
    def zml_request_headers(self, headers: dict[str, str]) -> None:
        """Add ``x-request-id`` (when the call is made while serving a request)."""
        rid = CURRENT.get()
        if rid is not None:
            headers[HEADER] = rid
