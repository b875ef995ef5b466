"""Opening a stream: dispatch (failover included) until the first token, for both clients.

An attempt is watched by its client's deadline watchdog (:mod:`zml.watchdog`) from *before* its
request is sent, until ``first_token`` or the deadline, the earlier: the connect, the upload,
the wait for the response's headers (which a node may drip byte by byte, or stretch with
``102 Processing`` interim responses), an error status's body and the wait for the first token
all end there, whatever the node sends. Once the first token came, the stream is watched until
the deadline alone (:meth:`StreamAttempt.opened`).

An error status's body is read up to :data:`~zml.transport.MAX_ERROR_BODY_BYTES` only (what
``NodeStatusError.body`` keeps); the rest is never read, the connection is dropped.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx2

from .dispatch import Call, Step, Wait, adrive, drive
from .errors import NodeConnectionError, NodeProtocolError, NodeTimeoutError
from .sse import EventSplitter, StreamDecoder
from .transport import aread_error_body, check_status, map_transport_error, read_error_body
from .types import ChatCompletionChunk
from .watchdog import LoopWatchdog, Watch, Watchdog

__all__ = ["StreamAttempt", "StreamExpired", "Target", "open_async", "open_sync", "read_next"]

Target = Callable[[Call, Step], httpx2.Request]
"""An attempt's request: its body, to its node, with its headers (the client's ``_request``)."""


class StreamExpired(Exception):
    """The stream's deadline passed (internal; mapped to a timeout error)."""


class StreamAttempt:
    """One attempt's response while it is being opened, then the open stream's read state.

    Holds no reference to the stream object, so that the stream alone decides its lifetime.
    """

    __slots__ = ("body", "call", "deadline", "decoder", "first_by", "response", "splitter",
                 "step", "watch")

    def __init__(self, call: Call, step: Step) -> None:
        self.call: Call = call
        self.step: Step = step
        self.decoder: StreamDecoder = StreamDecoder(step.node.id, step.routing)
        self.splitter: EventSplitter = EventSplitter(step.node.id)
        self.response: httpx2.Response | None = None
        self.body: Any = None
        first = call.timeouts.first_token
        self.first_by: float | None = None if first is None else step.sent_at + first
        self.deadline: float | None = call.deadline
        self.watch: Watch | None = None
        """The client's watchdog entry for this attempt (see :mod:`zml.watchdog`)."""

    def expired(self) -> bool:
        """Whether the watchdog shut the response down at the request's deadline."""
        watch = self.watch
        return watch is not None and watch.fired

    def unwatch(self) -> None:
        """Stop watching (idempotent)."""
        watch = self.watch
        if watch is not None:
            watch.end()

    def request(self, target: Target, dog: Watchdog | LoopWatchdog) -> httpx2.Request:
        """The attempt's request, watched until the first token or the deadline from now on,
        before it is sent."""
        request = target(self.call, self.step)
        self.step.sent_headers = request.headers
        until = self.opening_until()  # none: an endless watch, which the client's close ends
        self.watch = dog.watch(math.inf if until is None else until, request)
        return request

    def arrived(self, response: httpx2.Response) -> None:
        """The response's headers are in: watch the response from now on (:class:`StreamExpired` if
        the watch fired before they came)."""
        self.response = response
        watch = self.watch
        if watch is not None and not watch.follow(response):
            raise StreamExpired

    def started(self, request: httpx2.Request, response: httpx2.Response) -> None:
        """Headers in, status fine: check it is an event stream; reads now wait ``idle``.

        The first-token timeout was the read timeout until now; the transport takes the body's
        read timeout from the request's ``timeout`` extension when the body is first read.
        """
        kind = response.headers.get("content-type", "").partition(";")[0].strip().lower()
        if kind != "text/event-stream":
            node = self.step.node.id
            raise NodeProtocolError(
                f"node {node!r} answered a stream request with content-type {kind or 'none'!r}, "
                "not text/event-stream",
                node_id=node,
            )
        timeout = request.extensions.get("timeout")
        if isinstance(timeout, dict):
            timeout["read"] = self.call.idle_timeout()

    def opened(self, dog: Watchdog | LoopWatchdog) -> None:
        """The first token came: from now on the stream is watched until the deadline alone."""
        first, deadline = self.first_by, self.deadline
        if first is not None and (deadline is None or first < deadline):
            self.unwatch()
            self.watch = dog.watch(math.inf if deadline is None else deadline, self.response)

    def opening_until(self) -> float | None:
        """When the wait for the first token ends (first_token or the deadline, the earlier)."""
        first, deadline = self.first_by, self.deadline
        if first is None:
            return deadline
        return first if deadline is None else min(first, deadline)

    def take(self, data: bytes, out: list[ChatCompletionChunk]) -> None:
        """Decode one read's bytes, appending its chunks to ``out`` (none after ``[DONE]``)."""
        decoder = self.decoder
        for payload in self.splitter.feed(data):
            chunk = decoder.feed(payload)
            if chunk is None:
                return
            out.append(chunk)

    def feed(self, data: bytes | None, ready: list[ChatCompletionChunk],
             clock: Callable[[], float]) -> bool:
        """One read while waiting for the first token (``data`` None: the body ended).
        Returns whether to keep reading: False once the stream opened or ended."""
        if data is None:
            self.ended_early()
            return False
        self.take(data, ready)
        if self.is_open():
            return False
        self.check_opening(clock())
        return True

    def is_open(self) -> bool:
        """Whether opening is over: progress (or the whole answer) arrived."""
        return self.decoder.progressed or self.decoder.done

    def check_opening(self, now: float) -> None:
        """Raise :meth:`no_token` if the wait for the first token is over at ``now``."""
        until = self.opening_until()
        if until is not None and now >= until:
            raise self.no_token()

    def no_token(self) -> NodeTimeoutError:
        """The error for an attempt whose first token did not come in time."""
        node = self.step.node.id
        first = self.first_by
        what = (f"first_token={self.call.timeouts.first_token}s"
                if first is not None and (self.deadline is None or first <= self.deadline)
                else "the request deadline")
        return NodeTimeoutError(f"node {node!r} timed out: it sent no token within {what}",
                                node_id=node)

    def ended_early(self) -> None:
        """The body ended while opening: complete (an empty answer) or a failed attempt."""
        decoder = self.decoder
        if decoder.done or decoder.finished:
            return
        node = self.step.node.id
        raise NodeConnectionError(
            f"node {node!r} closed the stream after {decoder.chunks} events and no token",
            node_id=node,
        )

    def error(self, exc: BaseException) -> BaseException:
        """The error to raise for a failure while opening (retryable where the node's fault)."""
        if isinstance(exc, StreamExpired) or self.expired():
            return self.no_token()
        if isinstance(exc, httpx2.HTTPError):
            return map_transport_error(exc, self.step.node.id)
        return exc


def open_sync(call: Call, http: httpx2.Client, wait: Callable[[Wait], None],
              watchdog: Watchdog, target: Target) -> tuple[StreamAttempt, list[ChatCompletionChunk]]:
    """Dispatch a stream (failover included) until its first token arrives."""

    def attempt(step: Step) -> tuple[StreamAttempt, list[ChatCompletionChunk]]:
        op = StreamAttempt(call, step)
        clock = call.d.clock
        try:
            request = op.request(target, watchdog)
            response = http.send(request, stream=True)
            op.arrived(response)
            if response.status_code >= 300:  # an error, or a redirect zml does not follow
                check_status(response.status_code, response.headers,
                             read_error_body(response), step.node.id, request.headers)
            op.started(request, response)
            op.body = body = response.iter_bytes()
            ready: list[ChatCompletionChunk] = []
            while op.feed(next(body, None), ready, clock):
                pass
            return op, ready
        except BaseException as exc:
            op.unwatch()
            if op.response is not None:
                op.response.close()
            err = op.error(exc)
            if err is exc:
                raise
            raise err from exc

    step, opened = drive(call, wait, attempt)
    call.first_token(step)
    opened[0].opened(watchdog)
    return opened


async def open_async(call: Call, http: httpx2.AsyncClient,
                     wait: Callable[[Wait], Awaitable[None]], deadlines: LoopWatchdog,
                     target: Target) -> tuple[StreamAttempt, list[ChatCompletionChunk]]:
    """:func:`open_sync` for the async client."""

    async def attempt(step: Step) -> tuple[StreamAttempt, list[ChatCompletionChunk]]:
        op = call.opening = StreamAttempt(call, step)  # what AsyncStream.aclose() stops
        clock = call.d.clock
        try:
            request = op.request(target, deadlines)
            response = await http.send(request, stream=True)
            op.arrived(response)
            if response.status_code >= 300:  # an error, or a redirect zml does not follow
                check_status(response.status_code, response.headers,
                             await aread_error_body(response), step.node.id, request.headers)
            op.started(request, response)
            op.body = body = response.aiter_bytes()
            ready: list[ChatCompletionChunk] = []
            while op.feed(await read_next(body), ready, clock):
                pass
            return op, ready
        except BaseException as exc:
            op.unwatch()
            if op.response is not None:
                await op.response.aclose()
            err = op.error(exc)
            if err is exc:
                raise
            raise err from exc

    try:
        step, opened = await adrive(call, wait, attempt)
    finally:
        call.opening = None
    call.first_token(step)
    opened[0].opened(deadlines)
    return opened


async def read_next(body: AsyncIterator[bytes]) -> bytes | None:
    """The next read of a response body (None at its end)."""
    try:
        return await body.__anext__()
    except StopAsyncIteration:
        return None
