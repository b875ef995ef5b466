"""``POST /v1/chat/completions``: one OpenAI request in, one ``AsyncClient`` call, one answer out.

This is the hot path, written as a plain ASGI callable (no request/response objects): the body
is read within ``[gateway] body_timeout_s`` (else 408), parsed once, handed to ``infer`` /
``infer_stream`` (every field besides ``model``, ``messages``, ``stream`` and ``metadata`` is
passed through to the node: OpenAI's parameters as ``infer``'s keyword arguments, so that a bad
one is named as the client sent it, ``temperature``; any other field in ``extra_body``), and the
answer is serialised once by pydantic's Rust serializer, with ``zml_routing`` spliced in.
Chunks are not validated again: the client built them from the node's JSON without validation.

Every argument is validated by the client before a node is called, for JSON and streamed
requests alike, and a refusal is the same 400 naming the ``param``. An answer that cannot be
serialised (a node's text that is not valid Unicode) is an OpenAI-shaped 500, or, in a stream,
an SSE error event; an unexpected exception is counted with outcome ``error``, never ``ok``.

``metadata`` (a JSON object) becomes the call's zml metadata (labels for plugins and
chargeback, echoed in ``zml_routing.metadata``) rather than a node parameter.

Streams: the response starts (status 200 and the ``x-zml-*`` headers) once the request has a
node and its first chunk; failover happens before that, so an error before it is an ordinary
HTTP error. The usage chunk is passed on only when ``stream_options.include_usage`` asked for
it (zml always asks the node, for its own accounting). The final chunk (the usage chunk, else
the one with ``finish_reason``) is held back until the stream ends, to carry ``zml_routing``.
A failure after the first chunk ends the stream with an SSE error event in OpenAI's error shape
and no ``[DONE]``: never a silent short stream.

Disconnects: a watcher task reads ``receive()`` while the request runs; when the client goes
away (queued, waiting for the node, or mid-stream) it cancels the request, and the client
closes the node connection, which is how the node learns to drop the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import json
import sys
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import zml
from zml.dispatch.request import OPENAI_PARAMS
from zml.errors import InvalidRequestError
from zml.types import ChatCompletion, ChatCompletionChunk

from .errors import ErrorReply, error_reply, invalid_request, reply_for
from .headers import routing_headers, routing_json, with_routing
from .selection import Selection

if TYPE_CHECKING:
    from zml.types import RoutingInfo

    from .app import Gateway
    from .auth import GatewayKey

__all__ = ["SERVING", "AttemptLabels", "ChatCompletions", "Outcome"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

_JSON = (b"content-type", b"application/json")
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache"),
        (b"x-accel-buffering", b"no")]
_RESERVED = frozenset({"model", "messages", "stream", "metadata"})
_PARAMS = OPENAI_PARAMS - {"extra_body"}
"""Body fields passed to ``infer`` as keyword arguments; any other goes in ``extra_body``."""
_EXTRA = "extra_body."
_NO_ROUTING = {"routing"}
_COMPLETION = ChatCompletion.__pydantic_serializer__
_CHUNK = ChatCompletionChunk.__pydantic_serializer__


def _chunk_json(chunk: ChatCompletionChunk) -> bytes:
    """A chunk as a stream event's JSON, without zml's ``routing``.

    A tool call's delta leaves out what the node left out (its ``id``, ``type`` and
    ``function.name`` come only in the first delta of a call), as OpenAI's stream does:
    openai-python's stream helper copies an explicit ``"type": null`` over the call's type,
    then fails.
    """
    if not any(c.delta.tool_calls for c in chunk.choices):
        return _CHUNK.to_json(chunk, exclude=_NO_ROUTING)  # the common chunk
    data = _CHUNK.to_python(chunk, mode="json", exclude=_NO_ROUTING)
    for choice in data["choices"]:
        for call in choice["delta"].get("tool_calls") or ():
            for key in ("id", "type"):
                if call.get(key) is None:
                    call.pop(key, None)
            function = call.get("function")
            if isinstance(function, dict) and function.get("name") is None:
                function.pop("name", None)
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False).encode()
_DONE = b"data: [DONE]\n\n"


class _TooLarge(Exception):
    pass


class _TooSlow(Exception):
    pass


class _Guard:
    """Shared by a request and its disconnect watcher."""

    __slots__ = ("active", "fired")

    def __init__(self) -> None:
        self.active = True
        self.fired = False


async def _watch(receive: Receive, task: asyncio.Task[Any], guard: _Guard) -> None:
    while True:
        try:
            message = await receive()
        except Exception:  # a server whose receive() fails has lost the connection
            message = {"type": "http.disconnect"}
        if message["type"] == "http.disconnect":
            if guard.active:
                guard.fired = True
                task.cancel()
            return


async def _read_body(receive: Receive, limit: int, timeout_s: float) -> bytes | None:
    """The request body, or None when the client went away first.

    Raises:
        _TooLarge: the body is larger than ``limit`` bytes.
        _TooSlow: it did not arrive in full within ``timeout_s`` seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s

    async def next_message() -> Message:
        try:
            return await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
        except asyncio.TimeoutError:  # not TimeoutError itself before Python 3.11
            raise _TooSlow from None

    first = await next_message()
    if first["type"] == "http.disconnect":
        return None
    body: bytes = first.get("body", b"")
    if not first.get("more_body"):
        if len(body) > limit:
            raise _TooLarge
        return body
    parts = [body]
    size = len(body)
    while True:
        message = await next_message()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _TooLarge
        parts.append(chunk)
        if not message.get("more_body"):
            return b"".join(parts)


async def send_error(send: Send, reply: ErrorReply) -> None:
    """Answer with an OpenAI-shaped error."""
    body = reply.body()
    await send({"type": "http.response.start", "status": reply.status,
                "headers": [_JSON, (b"content-length", str(len(body)).encode()),
                            *reply.headers]})
    await send({"type": "http.response.body", "body": body})


class _Request:
    """One parsed chat request."""

    __slots__ = ("extra", "messages", "metadata", "model", "params", "stream", "want_usage")

    def __init__(self, model: object, messages: Any, stream: bool, want_usage: bool,
                 metadata: dict[str, Any] | None, params: dict[str, Any],
                 extra: dict[str, Any]) -> None:
        self.model = model
        self.messages = messages
        self.stream = stream
        self.want_usage = want_usage
        self.metadata = metadata
        self.params = params
        self.extra = extra


def _parse(body: bytes) -> _Request | ErrorReply:
    try:
        data = json.loads(body)
    except ValueError as exc:
        if "int_max_str_digits" in str(exc):  # Python's bound on int parsing, not JSON's
            return invalid_request(
                "the request body holds an integer of more than 4300 digits, more than any "
                "parameter takes: send a smaller number")
        return invalid_request(f"the request body is not valid JSON: {exc}")
    except RecursionError:  # the parser recurses: about 1000 levels exhaust the stack
        return invalid_request("the request body nests arrays or objects too deeply to be "
                               "parsed; no chat request needs more than a few levels")
    if not isinstance(data, dict):
        return invalid_request("the request body must be a JSON object")
    stream = data.get("stream")
    if stream is None:  # OpenAI's spec: boolean or null, default false
        stream = False
    if not isinstance(stream, bool):
        return invalid_request("'stream' must be true, false or null", "stream")
    metadata = data.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        return invalid_request("'metadata' must be a JSON object", "metadata")
    if "messages" not in data:
        return invalid_request("'messages' is required", "messages")
    if not isinstance(data["messages"], list):
        return invalid_request(
            "messages must be an array of message objects, e.g. "
            '[{"role": "user", "content": "Hello"}]', "messages")
    options = data.get("stream_options")
    if options is not None:
        if not isinstance(options, dict):
            return invalid_request(
                "stream_options must be an object, e.g. {\"include_usage\": true}, or null",
                "stream_options")
        if not stream:
            return invalid_request(
                "stream_options applies only to a stream: send \"stream\": true with it, "
                "or leave it out", "stream_options")
    want_usage = isinstance(options, dict) and bool(options.get("include_usage"))
    params = {k: v for k, v in data.items() if k in _PARAMS}
    extra = {k: v for k, v in data.items() if k not in _RESERVED and k not in _PARAMS}
    return _Request(data.get("model"), data["messages"], stream, want_usage, metadata, params,
                    extra)


class ChatCompletions:
    """The ASGI endpoint of ``POST /v1/chat/completions``."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gw = self.gateway
        started = time.perf_counter()
        authorization = policy_header = content_type = length = None
        two_keys = two_policies = False
        for name, value in scope["headers"]:
            if name == b"authorization":
                two_keys = two_keys or authorization is not None
                authorization = value
            elif name == b"x-zml-policy":
                two_policies = two_policies or policy_header is not None
                policy_header = value
            elif name == b"content-type":
                content_type = value
            elif name == b"content-length":  # the server checked it is one number
                length = value
        key: GatewayKey | None = None
        if gw.keys.enabled:  # first: a caller without a key learns nothing of the request
            key = None if two_keys else gw.keys.authenticate(authorization)
            if key is None:
                gw.metrics.finished(None, "", "", "unauthorized", False, 0.0)
                await send_error(send, error_reply(
                    401, ("the request has more than one Authorization header: send one, "
                          "'Authorization: Bearer <key>'" if two_keys else
                          "a valid gateway API key is required: send 'Authorization: Bearer "
                          "<key>' with a key the gateway's operator issued"),
                    "invalid_request_error", code="invalid_api_key",
                    headers=[(b"www-authenticate", b"Bearer")], outcome="unauthorized"))
                return
        repeated = "Authorization" if two_keys else "x-zml-policy" if two_policies else None
        if repeated is not None:
            gw.metrics.finished(None, "", "", "invalid_request", False, 0.0)
            await send_error(send, invalid_request(
                f"the request has more than one {repeated} header: send one", repeated.lower()))
            return
        if content_type is not None and not _json_type(content_type):
            gw.metrics.finished(None, "", "", "invalid_request", False, 0.0)
            await send_error(send, _not_json(content_type))
            return
        settings = gw.settings
        try:
            if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
                raise _TooLarge  # said at once, not after the upload (nor its timeout)
            body = await _read_body(receive, settings.max_body_bytes, settings.body_timeout_s)
        except _TooLarge:
            gw.metrics.finished(None, "", "", "invalid_request", False, 0.0)
            await send_error(send, invalid_request(
                f"the request body is larger than {settings.max_body_bytes} bytes "
                "([gateway] max_body_bytes)", status=413))
            return
        except _TooSlow:
            gw.metrics.finished(None, "", "", "invalid_request", False, 0.0)
            await send_error(send, error_reply(
                408, f"the request body did not arrive within {settings.body_timeout_s:g} s "
                "([gateway] body_timeout_s); the client stalled mid-body", "invalid_request_error",
                code="request_timeout", headers=[(b"connection", b"close")],
                outcome="invalid_request"))
            return
        if body is None:
            return
        request = _parse(body)
        if isinstance(request, ErrorReply):
            gw.metrics.finished(None, "", "", request.outcome, False, 0.0)
            await send_error(send, request)
            return
        header_policy = None if policy_header is None else header_text(policy_header)
        selection = gw.selector.select(request.model, header_policy)
        if isinstance(selection, ErrorReply):
            # Not the header's value as a label: clients must not grow the metrics at will.
            gw.metrics.finished(None, "", "", selection.outcome, request.stream, 0.0)
            await send_error(send, selection)
            return
        if key is not None and not key.allows(selection.policy):
            gw.metrics.finished(selection.policy, "", "", "forbidden", request.stream, 0.0)
            await send_error(send, _forbidden(key, selection))
            return
        task = asyncio.current_task()
        assert task is not None
        guard = _Guard()
        watcher = asyncio.ensure_future(_watch(receive, task, guard))
        gw.metrics.in_flight.inc()
        outcome = Outcome(selection.policy)
        token = SERVING.set(outcome)
        try:
            if request.stream:
                await self._stream(request, selection, send, guard, started, outcome)
            else:
                await self._json(request, selection, send, guard, outcome)
        except asyncio.CancelledError:
            if sys.version_info >= (3, 11):
                task.uncancel()
            outcome.kind = "cancelled"
            if not guard.fired:  # not the client gone: the server stopping (its shutdown timeout)
                await _shutting_down(send, outcome, guard)
        except Exception as exc:
            outcome.kind = "error"
            if outcome.started:
                raise  # uvicorn logs it and closes the connection: nothing else can be sent
            await _refuse(exc, send, guard, outcome)
        finally:
            SERVING.reset(token)
            guard.active = False
            watcher.cancel()
            gw.metrics.in_flight.dec()
            gw.metrics.finished(outcome.policy, outcome.family, outcome.node, outcome.kind,
                                request.stream, time.perf_counter() - started)

    async def _json(self, request: _Request, selection: Selection, send: Send, guard: _Guard,
                    outcome: Outcome) -> None:
        client = self.gateway.client
        try:
            completion = await client.infer(
                selection.model, request.messages, policy=selection.policy,
                metadata=request.metadata, extra_body=request.extra, **request.params)
        except Exception as exc:
            await _refuse(exc, send, guard, outcome)
            return
        routing = completion.routing
        outcome.served(routing)
        try:
            body = with_routing(_COMPLETION.to_json(completion, exclude=_NO_ROUTING),
                                routing_json(routing))
        except Exception as exc:  # e.g. a node's text that is not valid Unicode
            await _refuse(exc, send, guard, outcome)
            return
        headers = [_JSON, (b"content-length", str(len(body)).encode()),
                   *routing_headers(routing)]
        guard.active = False
        outcome.started = True
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        outcome.kind = "ok"

    async def _stream(self, request: _Request, selection: Selection, send: Send, guard: _Guard,
                      started: float, outcome: Outcome) -> None:
        gw = self.gateway
        try:  # infer_stream validates its arguments at once: they fail here, not in aenter
            stream = gw.client.infer_stream(
                selection.model, request.messages, policy=selection.policy,
                metadata=request.metadata, extra_body=request.extra, **request.params)
            await stream.__aenter__()
        except Exception as exc:
            await _refuse(exc, send, guard, outcome)
            return
        try:
            routing = stream.routing
            assert routing is not None
            outcome.served(routing)
            headers = [*_SSE, *routing_headers(routing)]
            outcome.started = True
            await send({"type": "http.response.start", "status": 200, "headers": headers})
            want_usage = request.want_usage
            held: bytes | None = None
            last: ChatCompletionChunk | None = None
            first = True
            try:
                async for chunk in stream:
                    if chunk.usage is not None and not chunk.choices and not want_usage:
                        continue
                    data = _chunk_json(chunk)
                    last = chunk
                    if held is not None:
                        await send({"type": "http.response.body",
                                    "body": b"data: " + held + b"\n\n", "more_body": True})
                        held = None
                    if chunk.usage is not None or any(c.finish_reason for c in chunk.choices):
                        held = data
                        continue
                    await send({"type": "http.response.body", "body": b"data: " + data + b"\n\n",
                                "more_body": True})
                    if first:
                        first = False
                        gw.metrics.ttft.labels(outcome.policy or "", outcome.family).observe(
                            time.perf_counter() - started)
                if held is None:
                    held = _closing_chunk(last)
                final = b"data: " + with_routing(held, routing_json(routing)) + b"\n\n" + _DONE
            except Exception as exc:  # after the first chunk: an error event, never silence
                reply = reply_for(exc)
                outcome.kind = "stream_error"
                tail = b"" if held is None else b"data: " + held + b"\n\n"
                guard.active = False
                await send({"type": "http.response.body", "body": tail + reply.sse_event()})
                return
            guard.active = False
            await send({"type": "http.response.body", "body": final})
            outcome.kind = "ok"
        finally:
            await stream.__aexit__(None, None, None)


def _json_type(content_type: bytes) -> bool:
    """Whether a request's Content-Type declares JSON (``application/json``, ``...+json``).

    Anything else is refused: a browser on any web page may send a "simple" cross-site POST
    (``text/plain``, a form) to a gateway on this machine without asking first, but never one
    declared JSON. A request with no Content-Type at all is read as JSON."""
    kind = content_type.partition(b";")[0].strip().lower()
    return kind == b"application/json" or kind.endswith(b"+json")


def _not_json(content_type: bytes) -> ErrorReply:
    shown = content_type.partition(b";")[0].strip().decode("latin-1")[:60] or "none"
    return error_reply(
        415, f"the request body must be JSON sent with Content-Type: application/json, not "
        f"{shown!r} (with curl: -H 'Content-Type: application/json')", "invalid_request_error",
        code="unsupported_media_type", outcome="invalid_request")


def header_text(value: bytes) -> str:
    """A request header's value as text: UTF-8 (else Latin-1), without the whitespace around
    it (not part of a field value, RFC 9110 5.5, though a server may pass it on), and
    percent-decoded when it holds ``%``, the mirror of how the gateway sends a non-ASCII name
    (``x-zml-policy``)."""
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError:
        text = value.decode("latin-1")
    text = text.strip(" \t")
    return unquote(text) if "%" in text else text


SERVING: contextvars.ContextVar[Outcome | None] = contextvars.ContextVar(
    "zml_gateway_outcome", default=None)
"""The outcome of the request being served (its task and the zml call it makes share it)."""


def _closing_chunk(last: ChatCompletionChunk | None) -> bytes:
    """A chunk with no choices, to carry ``zml_routing`` when no chunk was final."""
    head = {"id": "", "object": "chat.completion.chunk", "created": 0, "model": "",
            "choices": []}
    if last is not None:
        head.update(id=last.id, created=last.created, model=last.model)
    return json.dumps(head, separators=(",", ":")).encode()


class AttemptLabels:
    """A plugin of the gateway's own client: each attempt's node becomes the request's metric
    labels as it is sent, so that a request cancelled (or failed) mid-dispatch is counted under
    the node that had it, not under an empty one."""

    @zml.hookimpl
    def zml_request_headers(self, routing: RoutingInfo) -> None:
        """Record where the attempt goes on the request being served (if any)."""
        outcome = SERVING.get()
        if outcome is not None:
            outcome.served(routing)


class Outcome:
    """How a request ended, for the metrics (``kind`` is ``error`` until it is known)."""

    __slots__ = ("family", "kind", "node", "policy", "started")

    def __init__(self, policy: str | None) -> None:
        self.policy: str | None = policy
        self.family: str = ""
        self.node: str = ""
        self.kind: str = "error"
        self.started: bool = False
        """Whether the response has started (an error can then no longer be a reply)."""

    def served(self, routing: Any) -> None:
        """Record where the request went (its family and node)."""
        self.family = routing.accelerator
        self.node = routing.node_id

    def failed(self, reply: ErrorReply, routing: Any) -> None:
        """Record the failure's outcome kind (and where it went, if it was routed)."""
        self.kind = reply.outcome
        if routing is not None:
            self.served(routing)


def _forbidden(key: GatewayKey, selection: Selection) -> ErrorReply:
    """The 403 of a key that may not use the selected policy, naming where it came from."""
    allowed = ", ".join(sorted(key.policies or ())) or "none"
    if selection.policy is None or selection.source is None:
        what, param = "requests without a policy (send an x-zml-policy header)", "x-zml-policy"
    else:
        where = {"x-zml-policy": "the x-zml-policy header", "model": "the model alias",
                 "default_policy": "[gateway] default_policy"}[selection.source]
        what, param = f"policy {selection.policy!r} (from {where})", selection.source
    return error_reply(403, f"this gateway key may not use {what}; allowed policies: {allowed}",
                       "permission_error", code="policy_not_allowed", param=param,
                       outcome="forbidden")


def _as_sent(exc: Exception) -> Exception:
    """``exc`` naming the field as the client sent it: the gateway passes every field that is
    not an OpenAI parameter in ``extra_body``, but the client sent it at the top level."""
    param = exc.param if isinstance(exc, InvalidRequestError) else None
    if param == "extra_body key":  # a key of the body itself
        return InvalidRequestError(str(exc).replace(param, "a key of the request body", 1))
    if param is None or not param.startswith(_EXTRA):
        return exc
    sent = param[len(_EXTRA):]
    return InvalidRequestError(str(exc).replace(param, sent, 1), param=sent)


_SHUTTING_DOWN = error_reply(
    503, "the gateway is shutting down and cancelled this request: send it again (another "
    "replica, or this one once it is back, will serve it)", "server_error",
    code="shutting_down", outcome="cancelled")
"""What a request cancelled by the server's shutdown gets: a 503 before its answer started,
an error event after (never a stream that ends silently short)."""


async def _shutting_down(send: Send, outcome: Outcome, guard: _Guard) -> None:
    """Tell the client its request was cancelled by the shutdown, in at most a second (the
    client may read nothing), then let the server go on stopping."""
    guard.active = False
    reply = _SHUTTING_DOWN
    with contextlib.suppress(Exception, asyncio.CancelledError, asyncio.TimeoutError):
        if outcome.started:
            await asyncio.wait_for(send({"type": "http.response.body", "body": reply.sse_event()}),
                                   1.0)
        else:
            await asyncio.wait_for(send_error(send, reply), 1.0)


async def _refuse(exc: Exception, send: Send, guard: _Guard, outcome: Outcome) -> None:
    """The request failed before its answer started: one OpenAI-shaped error reply."""
    reply = reply_for(_as_sent(exc))
    outcome.failed(reply, getattr(exc, "routing", None))
    guard.active = False
    await send_error(send, reply)
