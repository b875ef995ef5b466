"""Streamed answers: ``Stream`` (sync) and ``AsyncStream`` (async), real Python iterators.

A stream is dispatched like any request (routing, failover) until its first token arrives;
from then on it belongs to one node, and a failure raises instead of retrying.

Iteration. ``Stream`` is its own iterator (``next(stream)``, then ``for`` goes on from there);
``AsyncStream`` is its own async iterator (``anext(stream)``, ``async for``). Each holds one
read state, so iterating again continues where the last loop stopped, as with a file.

Lifetime, one mechanism. A stream is *new* (async only: not dispatched yet), *open* (a slot and
a connection are held) or *ended*; it moves to ended exactly once, through :meth:`_end`,
whatever the way: the answer completed, a failure, ``close()``/``aclose()``, leaving a
``with`` block, or garbage collection. Leaving a loop over a stream nobody else holds
(``for chunk in client.infer_stream(...): break``, an exception, a cancelled task) drops the
stream, and its finalizer ends it *at once*: it frees the slot and closes the connection
synchronously (the socket is shut down, so the node sees the disconnect before the caller
awaits anything). A finalizer only releases: it never awaits or sends; the async HTTP
response's own cleanup then runs on the event loop. A stream still held after ``break`` stays
open (it can be continued) until it is closed or dropped.

Deadlines and progress. ``timeout``/``Timeouts.total`` is one wall-clock deadline for the whole
call, enforced across reads whatever the node sends: every stream is watched by its client's
deadline watchdog (:mod:`zml.watchdog`), which shuts the socket down when the deadline passes,
and both kinds check the clock after every read. Progress for ``first_token`` is a chunk
carrying content, a tool call, a refusal or any other non-empty delta field, a finish_reason or
usage; SSE comments (keep-alives), role-only and empty deltas are not, so a node that only
keeps the connection busy fails over when ``first_token`` expires. ``idle`` bounds the silence
between two reads: any bytes, comments included, count as liveness. An async stream's wait
for its first token is watched the same way (until ``first_token`` or the deadline, the
earlier). Margins: a stream ends within a few milliseconds of its deadline (event-loop latency
for an async one, the deadline thread's wake-up for a sync one), however often the node sends;
``benchmarks/deadline_margin.py`` measures both.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any

import httpx2

from .dispatch import Call, ResponseSummary, Step, Wait, adrive, drive
from .errors import NodeConnectionError, NodeError, NodeProtocolError, NodeTimeoutError
from .sse import EventSplitter, StreamDecoder
from .transport import check_status, map_transport_error
from .types import ChatCompletionChunk, RoutingInfo, Usage
from .watchdog import LoopWatchdog, Watch, Watchdog, shutdown_socket

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["DRAIN_S", "AsyncStream", "Stream"]

DRAIN_S = 0.1
"""After ``[DONE]``, how long an async stream waits for the end of the HTTP response (so its
connection can be reused) before it closes the connection instead."""

_NEW, _OPEN, _ENDED = 0, 1, 2

Target = Callable[[Call, Step], "tuple[httpx2.URL, dict[str, str]]"]
"""Where an attempt is sent and with which headers (the client's ``_target``)."""


class _Expired(Exception):
    """The stream's deadline passed (internal; mapped to a timeout error)."""


class _Attempt:
    """One attempt's response while it is being opened, then the open stream's read state.

    Holds no reference to the stream object, so that the stream alone decides its lifetime.
    """

    __slots__ = ("body", "call", "deadline", "decoder", "first_by", "response", "splitter",
                 "step", "watch")

    def __init__(self, call: Call, step: Step) -> None:
        self.call = call
        self.step = step
        self.decoder = StreamDecoder(step.node.id, step.routing)
        self.splitter = EventSplitter(step.node.id)
        self.response: httpx2.Response | None = None
        self.body: Any = None
        first = call.timeouts.first_token
        self.first_by = None if first is None else step.sent_at + first
        self.deadline = call.deadline
        self.watch: Watch | None = None
        """The client's watchdog entry for this response (see :mod:`zml.watchdog`)."""

    def expired(self) -> bool:
        """Whether the watchdog shut the response down at the request's deadline."""
        watch = self.watch
        return watch is not None and watch.fired

    def unwatch(self) -> None:
        watch = self.watch
        if watch is not None:
            watch.end()

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
        if self.opened():
            return False
        self.check_opening(clock())
        return True

    def opened(self) -> bool:
        """Whether opening is over: progress (or the whole answer) arrived."""
        return self.decoder.progressed or self.decoder.done

    def check_opening(self, now: float) -> None:
        until = self.opening_until()
        if until is not None and now >= until:
            raise self.no_token()

    def no_token(self) -> NodeTimeoutError:
        node = self.step.node.id
        first = self.first_by
        what = (f"first_token={self.call.timeouts.first_token}s"
                if first is not None and (self.deadline is None or first <= self.deadline)
                else "the request deadline")
        return NodeTimeoutError(f"node {node!r} sent no token within {what}", node_id=node)

    def ended_early(self) -> None:
        """The body ended while opening: complete (an empty answer) or a failed attempt."""
        decoder = self.decoder
        if decoder.done or decoder.finish_reason is not None:
            return
        node = self.step.node.id
        raise NodeConnectionError(
            f"node {node!r} closed the stream after {decoder.chunks} events and no token",
            node_id=node,
        )

    def error(self, exc: BaseException) -> BaseException:
        """The error to raise for a failure while opening (retryable where the node's fault)."""
        if isinstance(exc, _Expired) or self.expired():
            return self.no_token()
        if isinstance(exc, httpx2.HTTPError):
            return map_transport_error(exc, self.step.node.id)
        return exc


def _open_sync(call: Call, http: httpx2.Client, wait: Callable[[Wait], None],
               watchdog: Watchdog, target: Target) -> tuple[_Attempt, list[ChatCompletionChunk]]:
    """Dispatch a stream (failover included) until its first token arrives."""

    def attempt(step: Step) -> tuple[_Attempt, list[ChatCompletionChunk]]:
        op = _Attempt(call, step)
        clock = call.d.clock
        try:
            url, headers = target(call, step)
            request = http.build_request("POST", url, content=call.body, headers=headers,
                                         extensions={"timeout": step.timeout})
            op.response = response = http.send(request, stream=True)
            if op.deadline is not None:
                op.watch = watchdog.watch(op.deadline, response)
            if response.status_code >= 400:
                response.read()
                check_status(response.status_code, response.headers, response.content,
                             step.node.id)
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
    return opened


async def _open_async(call: Call, http: httpx2.AsyncClient,
                      wait: Callable[[Wait], Awaitable[None]], deadlines: LoopWatchdog,
                      target: Target) -> tuple[_Attempt, list[ChatCompletionChunk]]:
    """:func:`_open_sync` for the async client; the wait for the first token is watched too
    (until ``first_token`` or the deadline, the earlier), then the deadline."""

    async def attempt(step: Step) -> tuple[_Attempt, list[ChatCompletionChunk]]:
        op = _Attempt(call, step)
        clock = call.d.clock
        try:
            url, headers = target(call, step)
            request = http.build_request("POST", url, content=call.body, headers=headers,
                                         extensions={"timeout": step.timeout})
            op.response = response = await http.send(request, stream=True)
            if response.status_code >= 400:
                await response.aread()
                check_status(response.status_code, response.headers, response.content,
                             step.node.id)
            op.started(request, response)
            op.body = body = response.aiter_bytes()
            until = op.opening_until()
            if until is not None:
                op.watch = deadlines.watch(until, response)
            ready: list[ChatCompletionChunk] = []
            while op.feed(await _read(body), ready, clock):
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

    step, opened = await adrive(call, wait, attempt)
    call.first_token(step)
    op = opened[0]
    if op.first_by is not None and (op.deadline is None or op.first_by < op.deadline):
        op.unwatch()  # the first token came: from now on the deadline alone
        op.watch = None if op.deadline is None else deadlines.watch(op.deadline, op.response)
    return opened


async def _read(body: AsyncIterator[bytes]) -> bytes | None:
    """The next read of a response body (None at its end)."""
    try:
        return await body.__anext__()
    except StopAsyncIteration:
        return None


class _Base:
    """What both streams share: the read state once open, and the one way a stream ends."""

    __slots__ = ("_call", "_op", "_phase", "_ready")

    _call: Call
    _op: _Attempt | None
    _phase: int
    _ready: list[ChatCompletionChunk]

    @property
    def routing(self) -> RoutingInfo | None:
        """Where the stream went (None for an async stream not yet dispatched)."""
        op = self._op
        return None if op is None else op.step.routing

    @property
    def text(self) -> str:
        """The content of the chunks delivered so far (all of it once the stream ended)."""
        op = self._op
        if op is None:
            return ""
        text = op.decoder.text
        if self._ready:  # decoded, not delivered yet: the end of ``text``
            pending = sum(len(c.delta.content or "") for chunk in self._ready
                          for c in chunk.choices)
            text = text[:len(text) - pending]
        return text

    @property
    def finish_reason(self) -> str | None:
        """The finish_reason, once received."""
        op = self._op
        return None if op is None else op.decoder.finish_reason

    @property
    def usage(self) -> Usage | None:
        """Token usage, once the final chunk arrived."""
        op = self._op
        return None if op is None else op.decoder.usage

    def _adopt(self, opened: tuple[_Attempt, list[ChatCompletionChunk]]) -> None:
        op, ready = opened
        self._op = op
        ready.reverse()
        self._ready = ready
        self._phase = _OPEN

    def _take(self, data: bytes) -> ChatCompletionChunk | None:
        """Decode one read: its first chunk (the others wait in ``_ready``), or None."""
        op = self._op
        assert op is not None
        deadline = op.deadline
        if deadline is not None and self._call.d.clock() >= deadline:
            raise _Expired
        events = op.splitter.feed(data)
        if not events:
            return None
        if len(events) == 1:  # the common read: one event, decoded without a list
            return op.decoder.feed(events[0])  # None for [DONE]
        chunks: list[ChatCompletionChunk] = []
        for payload in events:
            chunk = op.decoder.feed(payload)
            if chunk is None:
                break
            chunks.append(chunk)
        if not chunks:
            return None
        chunks.reverse()
        self._ready = chunks
        return chunks.pop()

    def _end(self, error: BaseException | None = None, *, complete: bool = False) -> bool:
        """End the call once (False if it had ended): success, an error, or walking away.

        Frees the slot at once; the caller closes the connection (or the finalizer does).
        """
        if self._phase == _ENDED:
            return False
        self._phase = _ENDED
        op = self._op
        if op is not None:
            op.unwatch()
        if complete and op is not None:
            decoder = op.decoder
            last = decoder.last
            summary = ResponseSummary(last.id if last else None, last.model if last else None,
                                      decoder.finish_reason)
            usage = None if decoder.usage is None else decoder.usage.model_dump()
            self._call.succeeded(op.step, usage, summary)
        else:
            self._call.ended(error)
        return True

    def _failure(self, exc: BaseException) -> BaseException:
        """End the call for ``exc`` raised while reading an open stream; the error to raise."""
        op = self._op
        assert op is not None
        call = self._call
        err: BaseException = exc
        if isinstance(exc, _Expired) or op.expired():
            err = call.deadline_error(op.decoder)
        elif isinstance(exc, httpx2.HTTPError):
            deadline = op.deadline
            if isinstance(exc, httpx2.TimeoutException) and deadline is not None \
                    and call.d.clock() >= deadline:
                err = call.deadline_error(op.decoder)
            else:
                why = "idle timeout" if isinstance(exc, httpx2.TimeoutException) \
                    else type(exc).__name__
                err = op.decoder.incomplete(why)
                err.__cause__ = exc
        if isinstance(err, NodeError):
            err = call.broke(op.step, err)
        self._end(err)
        return err


class Stream(_Base):
    """A sync stream of :class:`~zml.types.ChatCompletionChunk` (already dispatched).

    Use as ``for chunk in stream``, ``next(stream)`` or ``with client.infer_stream(...) as
    stream``. See the module's docs for its lifetime and deadlines.
    """

    __slots__ = ()

    def __init__(self, call: Call, http: httpx2.Client, wait: Callable[[Wait], None],
                 watchdog: Watchdog, target: Target) -> None:
        self._call = call
        self._op = None
        self._phase = _NEW
        self._ready = []
        try:
            opened = _open_sync(call, http, wait, watchdog, target)
        except BaseException:
            self._phase = _ENDED  # the driver ended the call
            raise
        self._adopt(opened)

    def __del__(self) -> None:
        # Dropped before its end: free the slot, close the connection (a release, no I/O wait).
        if getattr(self, "_phase", _ENDED) != _ENDED and self._end():
            op = self._op
            if op is not None and op.response is not None:
                op.response.close()

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> ChatCompletionChunk:
        ready = self._ready
        if ready:
            return ready.pop()
        op = self._op
        if self._phase != _OPEN or op is None:
            raise StopIteration
        try:
            body = op.body
            while not op.decoder.done:
                data = next(body, None)
                if data is None:
                    break
                chunk = self._take(data)
                if chunk is not None:
                    return chunk
            op.decoder.finish()
            if op.decoder.done:
                _drain(body)
        except BaseException as exc:
            err = self._failure(exc)
            self._close()
            if err is exc:
                raise
            raise err from exc if isinstance(exc, httpx2.HTTPError) else None
        self._end(complete=True)
        self._close()
        raise StopIteration

    def _close(self) -> None:
        op = self._op
        if op is not None:
            if op.response is not None:
                op.response.close()
            op.body = None

    def close(self) -> None:
        """Stop the stream: close the connection (the node drops the request) and free the slot."""
        if self._end():
            self._close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def _drain(body: Iterator[bytes]) -> None:
    """Read the end of a response after ``[DONE]`` so its connection can be reused."""
    with contextlib.suppress(httpx2.HTTPError):
        for _ in body:
            break


class AsyncStream(_Base):
    """An async stream of :class:`~zml.types.ChatCompletionChunk`, dispatched on first use.

    Use as ``async for chunk in client.infer_stream(...)`` (no ``await`` first),
    ``await anext(stream)``, or ``async with client.infer_stream(...) as stream``. See the
    module's docs for its lifetime and deadlines.
    """

    __slots__ = ("_deadlines", "_http", "_on_start", "_target", "_wait")

    def __init__(self, call: Call, http: httpx2.AsyncClient, wait: Callable[[Wait], Any],
                 deadlines: LoopWatchdog, target: Target,
                 on_start: Callable[[], None] | None = None) -> None:
        self._call = call
        self._http = http
        self._target = target
        self._wait = wait
        self._deadlines = deadlines
        self._on_start = on_start
        self._op = None
        self._phase = _NEW
        self._ready = []

    def __del__(self) -> None:
        # Dropped before its end: free the slot and shut the connection down at once. Never
        # awaits: the response's async cleanup is left to the event loop (its body generator's
        # finalizer), after the node has already seen the disconnect.
        if getattr(self, "_phase", _ENDED) != _ENDED and self._end():
            op = self._op
            if op is not None and op.response is not None:
                shutdown_socket(op.response)

    async def _open(self) -> None:
        if self._on_start is not None:
            self._on_start()
        try:
            opened = await _open_async(self._call, self._http, self._wait, self._deadlines,
                                       self._target)
        except BaseException:
            self._phase = _ENDED  # the driver ended the call
            raise
        self._adopt(opened)

    def __aiter__(self) -> AsyncStream:
        return self

    async def __anext__(self) -> ChatCompletionChunk:
        ready = self._ready
        if ready:
            return ready.pop()
        if self._phase != _OPEN:
            if self._phase == _ENDED:
                raise StopAsyncIteration
            await self._open()
            if self._ready:
                return self._ready.pop()
        op = self._op
        assert op is not None
        try:
            body = op.body
            while not op.decoder.done:
                try:
                    data = await body.__anext__()
                except StopAsyncIteration:
                    break
                chunk = self._take(data)
                if chunk is not None:
                    return chunk
            op.decoder.finish()
            if op.decoder.done:
                await self._drain(op, body)
        except BaseException as exc:
            err = self._failure(exc)
            await self._close()
            if err is exc:
                raise
            raise err from exc if isinstance(exc, httpx2.HTTPError) else None
        self._end(complete=True)
        await self._close()
        raise StopAsyncIteration

    async def _drain(self, op: _Attempt, body: AsyncIterator[bytes]) -> None:
        """Read the end of the response after ``[DONE]`` (at most :data:`DRAIN_S`)."""
        op.unwatch()
        op.watch = self._deadlines.watch(self._call.d.clock() + DRAIN_S, op.response)
        with contextlib.suppress(httpx2.HTTPError):
            await _read(body)

    async def _close(self) -> None:
        op = self._op
        if op is not None:
            op.unwatch()
            op.body = None
            if op.response is not None:
                await op.response.aclose()

    async def aclose(self) -> None:
        """Stop the stream: close the connection (the node drops the request), free the slot."""
        if self._end():
            await self._close()

    async def __aenter__(self) -> AsyncStream:
        if self._phase == _NEW:
            await self._open()
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()
