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
between two reads: any bytes, comments included, count as liveness. Each attempt is watched
from before its request is sent until ``first_token`` or the deadline, the earlier, so the
connect, the upload and the wait for the headers are bounded too (:mod:`zml.stream_open`).
After ``[DONE]`` the call ends at once (its slot is free), then the end of the response is
read for at most :data:`DRAIN_S` so that the connection can be reused. Margins: a stream ends within a few milliseconds of its deadline (event-loop latency
for an async one, the deadline thread's wake-up for a sync one), however often the node sends;
``benchmarks/deadline_margin.py`` measures both.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

import httpx2

from .dispatch import Call, CallStopped, ResponseSummary, Wait
from .errors import ClientConfigError, InvalidRequestError, NodeError
from .stream_open import StreamAttempt, StreamExpired, Target, open_async, open_sync, read_next
from .types import ChatCompletionChunk, RoutingInfo, Usage
from .watchdog import LoopWatchdog, Watchdog, shutdown_socket

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["DRAIN_S", "AsyncStream", "Stream"]

DRAIN_S = 0.1
"""After ``[DONE]``, how long a stream waits for the end of the HTTP response (so its
connection can be reused) before it closes the connection instead."""

_NEW, _OPEN, _ENDED, _OPENING = 0, 1, 2, 3


class _Base:
    """What both streams share: the read state once open, and the one way a stream ends."""

    __slots__ = ("_call", "_op", "_phase", "_ready")

    _call: Call
    _op: StreamAttempt | None
    _phase: int
    _ready: list[ChatCompletionChunk]

    @property
    def routing(self) -> RoutingInfo | None:
        """Where the stream went (None for an async stream not yet dispatched)."""
        op = self._op
        return None if op is None else op.step.routing

    @property
    def text(self) -> str:
        """The content of the chunks delivered so far (all of it once the stream ended): the
        first choice's, with ``n`` > 1 (as ``response.choices[0].message.content``)."""
        op = self._op
        if op is None:
            return ""
        text = op.decoder.text
        if self._ready:  # decoded, not delivered yet: the end of ``text``
            pending = sum(len(c.delta.content or "") for chunk in self._ready
                          for c in chunk.choices if not c.index)
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

    def _adopt(self, opened: tuple[StreamAttempt, list[ChatCompletionChunk]]) -> None:
        op, ready = opened
        watch = op.watch
        if watch is not None:  # held unread past its deadline, the stream frees its slot then
            step = op.step
            watch.on_fire = functools.partial(step.node.fleet.release, step.reservation)
        scrub = op.step.scrub_answer  # the attempt's credentials, out of each chunk's metadata
        if scrub is not None:
            for chunk in ready:
                scrub(chunk.__dict__)
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
            raise StreamExpired
        events = op.splitter.feed(data)
        if not events:
            return None
        scrub = op.step.scrub_answer  # see _adopt
        if len(events) == 1:  # the common read: one event, decoded without a list
            chunk = op.decoder.feed(events[0])  # None for [DONE]
            if chunk is not None and scrub is not None:
                scrub(chunk.__dict__)
            return chunk
        chunks: list[ChatCompletionChunk] = []
        for payload in events:
            chunk = op.decoder.feed(payload)
            if chunk is None:
                break
            if scrub is not None:
                scrub(chunk.__dict__)
            chunks.append(chunk)
        if not chunks:
            return None
        chunks.reverse()
        self._ready = chunks
        return chunks.pop()

    def _answered(self) -> bool:
        """Whether the caller has had the whole answer: every choice got its finish_reason and
        no decoded chunk with choices is still waiting for it (a usage-only one may). A stream
        closed then (before ``[DONE]``, or the usage chunk that may follow) completed: its
        usage, if it arrived, and its cost are recorded."""
        op = self._op
        return op is not None and op.decoder.finished \
            and all(not chunk.choices for chunk in self._ready)

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
                                      decoder.finish_reason, decoder.finish_reasons)
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
        closed = call.closed() if isinstance(exc, Exception) else None
        if closed is not None:  # the client was closed under the stream: not the node's doing
            err = closed
        elif isinstance(exc, StreamExpired) or op.expired():
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


def _cause(exc: BaseException, err: BaseException) -> BaseException | None:
    """What ``err``, raised for a read that failed with ``exc``, chains to: the transport's
    error, not zml's own (nor anything once the client was closed)."""
    return exc if isinstance(exc, httpx2.HTTPError) and not isinstance(err, ClientConfigError) \
        else None


class Stream(_Base):
    """A sync stream of :class:`~zml.types.ChatCompletionChunk` (already dispatched).

    Use as ``for chunk in stream``, ``next(stream)`` or ``with client.infer_stream(...) as
    stream``. See the module's docs for its lifetime and deadlines.
    """

    __slots__ = ("_watchdog",)

    def __init__(self, call: Call, http: httpx2.Client, wait: Callable[[Wait], None],
                 watchdog: Watchdog, target: Target) -> None:
        self._call = call
        self._op = None
        self._phase = _NEW
        self._ready = []
        self._watchdog = watchdog
        try:
            opened = open_sync(call, http, wait, watchdog, target)
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
        except BaseException as exc:
            if self._phase == _ENDED and isinstance(exc, Exception):
                # close() ran in another thread while this one read: not the node's failure
                self._close()
                raise StopIteration from None
            err = self._failure(exc)
            self._close()
            if err is exc:
                raise
            raise err from _cause(exc, err)
        self._end(complete=True)  # the slot is free from here, whatever the drain takes
        try:
            if op.decoder.done:
                self._drain(op, body)
        finally:
            self._close()
        raise StopIteration

    def _drain(self, op: StreamAttempt, body: Iterator[bytes]) -> None:
        """Read the end of the response after ``[DONE]`` so its connection can be reused (at
        most :data:`DRAIN_S`, as the async stream)."""
        watch = self._watchdog.watch(self._call.d.clock() + DRAIN_S, op.response)
        try:
            with contextlib.suppress(httpx2.HTTPError):
                for _ in body:
                    break
        finally:
            watch.end()

    def _close(self) -> None:
        op = self._op
        if op is not None:
            if op.response is not None:
                op.response.close()
            op.body = None

    def close(self) -> None:
        """Stop the stream: close the connection (the node drops the request) and free the slot.

        After the last finish_reason the request counts as completed, else as cancelled."""
        if self._end(complete=self._answered()):
            self._close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


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
        if self._phase == _OPENING:
            # One call, one dispatch: a second opener would send the request again (and leave
            # the first attempt's slot held).
            raise InvalidRequestError(
                "this stream is being opened by another task: read a stream from one task at "
                "a time (as any async iterator), or make one infer_stream() per reader",
                param="stream")
        self._phase = _OPENING
        if self._on_start is not None:
            self._on_start()
        try:
            opened = await open_async(self._call, self._http, self._wait, self._deadlines,
                                      self._target)
        except CallStopped:  # aclose() ran, from another task, while this one opened
            self._phase = _ENDED
            return
        except BaseException:
            self._phase = _ENDED  # the driver ended the call
            raise
        if self._phase == _ENDED:  # aclose() ran, from another task, while this one opened
            self._op = opened[0]
            await self._close()  # the node drops the request; the call ended in aclose()
            return
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
            if self._phase == _ENDED:
                raise StopAsyncIteration
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
        except BaseException as exc:
            if self._phase == _ENDED and isinstance(exc, Exception):
                # aclose() ran in another task while this one read: not the node's failure
                await self._close()
                raise StopAsyncIteration from None
            err = self._failure(exc)
            await self._close()
            if err is exc:
                raise
            raise err from _cause(exc, err)
        self._end(complete=True)  # the slot is free from here, whatever the drain takes
        try:
            if op.decoder.done:
                await self._drain(op, body)
        finally:
            await self._close()
        raise StopAsyncIteration

    async def _drain(self, op: StreamAttempt, body: AsyncIterator[bytes]) -> None:
        """Read the end of the response after ``[DONE]`` (at most :data:`DRAIN_S`)."""
        op.unwatch()
        op.watch = self._deadlines.watch(self._call.d.clock() + DRAIN_S, op.response)
        with contextlib.suppress(httpx2.HTTPError):
            await read_next(body)

    async def _close(self) -> None:
        op = self._op
        if op is not None:
            op.unwatch()
            op.body = None
            if op.response is not None:
                await op.response.aclose()

    async def aclose(self) -> None:
        """Stop the stream: close the connection (the node drops the request), free the slot.

        From another task while the stream is still opening, it also stops the opening: the
        attempt's connection is shut down (or its wait in the saturation queue ended), and the
        task that opens it ends its loop (no failover, the node is not blamed). After the last
        finish_reason the request counts as completed, else as cancelled."""
        if self._end(complete=self._answered()):
            if self._op is None:
                self._call.stop()
            await self._close()

    async def __aenter__(self) -> AsyncStream:
        if self._phase in (_NEW, _OPENING):
            await self._open()
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()
