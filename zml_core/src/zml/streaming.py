"""Streamed answers: ``Stream`` (sync) and ``AsyncStream`` (async).

A stream is dispatched like any request (routing, failover) until its first chunk arrives;
from then on it belongs to one node, and a failure raises instead of retrying. Iteration is a
generator that only the ``for`` loop holds, so leaving the loop early (``break``, an exception,
task cancellation) closes the generator and with it the HTTP connection: the node sees the
disconnect and drops the request. ``close()`` / ``aclose()`` and the context-manager forms do
the same explicitly.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncGenerator, Awaitable, Callable, Coroutine, Iterator
from typing import TYPE_CHECKING, Any, overload

import httpx2

from .dispatch import Call, ResponseSummary, Step, Wait, adrive, drive
from .errors import NodeConnectionError, NodeError, ZMLTimeoutError
from .transport import StreamDecoder, aiter_events, check_status, iter_events, stream_error
from .types import ChatCompletionChunk, RoutingInfo, Usage, build_chunk

if TYPE_CHECKING:
    from types import TracebackType

__all__ = ["AsyncStream", "Stream"]


class _StreamState:
    """What a sync and an async stream share once dispatched (no I/O here)."""

    __slots__ = ("call", "closed", "decoder", "events", "first", "last", "response", "step",
                 "usage")

    def __init__(self, call: Call, step: Step, response: httpx2.Response, events: Any,
                 decoder: StreamDecoder, first: dict[str, Any] | None) -> None:
        self.call = call
        self.step = step
        self.response = response
        self.events = events  # the one SSE event iterator of this response (sync or async)
        self.decoder = decoder
        self.first = first
        self.last: ChatCompletionChunk | None = None
        self.closed = False
        self.usage: Usage | None = None

    def chunk(self, data: dict[str, Any]) -> ChatCompletionChunk:
        deadline = self.call.deadline
        if deadline is not None and self.call.d.clock() > deadline:
            raise self.call.deadline_error(self.decoder)
        chunk = build_chunk(data, self.step.routing)
        if chunk.usage is not None:
            self.usage = chunk.usage
        self.last = chunk
        return chunk

    def finished(self) -> None:
        self.decoder.finish()
        self.closed = True
        last = self.last
        summary = ResponseSummary(last.id if last else None, last.model if last else None,
                                  self.decoder.finish_reason)
        usage = None if self.usage is None else self.usage.model_dump()
        self.call.succeeded(self.step, usage, summary)


class _StreamInfo:
    _state: _StreamState | None

    @property
    def routing(self) -> RoutingInfo | None:
        """Where the stream went (None for an async stream not yet dispatched)."""
        return None if self._state is None else self._state.step.routing

    @property
    def text(self) -> str:
        """The content received so far."""
        return "" if self._state is None else self._state.decoder.text

    @property
    def finish_reason(self) -> str | None:
        """The finish_reason, once received."""
        return None if self._state is None else self._state.decoder.finish_reason

    @property
    def usage(self) -> Usage | None:
        """Token usage, once the final chunk arrived."""
        return None if self._state is None else self._state.usage


class Stream(_StreamInfo):
    """A sync stream of :class:`~zml.types.ChatCompletionChunk` (already dispatched).

    Use as ``for chunk in stream`` or ``with client.infer_stream(...) as stream``.
    """

    def __init__(self, call: Call, http: httpx2.Client, wait: Callable[[Wait], None]) -> None:
        self._state = None
        self._state = _open_sync(call, http, wait)

    def __del__(self) -> None:
        # A stream dropped without being read to the end or closed still frees its slot.
        state = getattr(self, "_state", None)
        if state is not None and not state.closed:
            state.closed = True
            state.call.ended(None)
            state.response.close()

    def __iter__(self) -> Iterator[ChatCompletionChunk]:
        state = self._state
        assert state is not None
        if state.closed:
            return
        decoder = state.decoder
        try:
            if state.first is not None:
                first, state.first = state.first, None
                yield state.chunk(first)
            if not decoder.done:
                for data in state.events:
                    chunk = decoder.feed(data)
                    if chunk is None:
                        break
                    yield state.chunk(chunk)
            state.finished()
        except httpx2.HTTPError as exc:
            err = _mid_stream_error(state, exc)
            if isinstance(err, NodeError):
                err = state.call.broke(state.step, err)
            raise err from exc
        except NodeError as exc:
            raise state.call.broke(state.step, exc) from None
        finally:
            if not state.closed:
                state.closed = True
                state.call.ended(sys.exc_info()[1])
            state.response.close()

    def close(self) -> None:
        """Stop the stream: close the connection (the node drops the request) and free the slot."""
        state = self._state
        if state is not None and not state.closed:
            state.closed = True
            state.call.ended(None)
            state.response.close()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class AsyncStream(_StreamInfo):
    """An async stream of :class:`~zml.types.ChatCompletionChunk`, dispatched on first use.

    Use as ``async for chunk in client.infer_stream(...)`` (no ``await`` first) or
    ``async with client.infer_stream(...) as stream``.
    """

    def __init__(self, call: Call, http: httpx2.AsyncClient,
                 wait: Callable[[Wait], Any], on_start: Callable[[], None] | None = None) -> None:
        self._call = call
        self._http = http
        self._wait = wait
        self._on_start = on_start
        self._state = None
        self._started = False

    def __del__(self) -> None:
        # A stream dropped before it was ever iterated still ends its call exactly once.
        if not self._started:
            self._started = True
            self._call.ended(None)

    async def _ensure_open(self) -> _StreamState | None:
        if not self._started:
            self._started = True
            if self._on_start is not None:
                self._on_start()
            self._state = await _open_async(self._call, self._http, self._wait)
        return self._state

    def __aiter__(self) -> AsyncGenerator[ChatCompletionChunk, None]:
        return _Chunks(self, self._iterate())

    async def _iterate(self) -> AsyncGenerator[ChatCompletionChunk, None]:
        state = await self._ensure_open()
        if state is None or state.closed:
            return
        decoder = state.decoder
        try:
            if state.first is not None:
                first, state.first = state.first, None
                yield state.chunk(first)
            if not decoder.done:
                async for data in state.events:
                    chunk = decoder.feed(data)
                    if chunk is None:
                        break
                    yield state.chunk(chunk)
            state.finished()
        except httpx2.HTTPError as exc:
            err = _mid_stream_error(state, exc)
            if isinstance(err, NodeError):
                err = state.call.broke(state.step, err)
            raise err from exc
        except NodeError as exc:
            raise state.call.broke(state.step, exc) from None
        finally:
            if not state.closed:
                state.closed = True
                state.call.ended(sys.exc_info()[1])
            await state.response.aclose()

    async def aclose(self) -> None:
        """Stop the stream: close the connection (the node drops the request), free the slot."""
        state = self._state
        if state is None:
            if not self._started:
                self._started = True
                self._call.ended(None)
            return
        if not state.closed:
            state.closed = True
            state.call.ended(None)
            await state.response.aclose()

    async def __aenter__(self) -> AsyncStream:
        await self._ensure_open()
        return self

    async def __aexit__(self, et: type[BaseException] | None, ev: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()


class _Chunks(AsyncGenerator[ChatCompletionChunk, None]):
    """The iterator of ``async for chunk in stream``: the stream's generator, plus a prompt
    release of the slot when the loop is left early.

    After ``break`` Python does not close an async generator at once: asyncio schedules its
    ``aclose()`` for later, and until then the slot would look taken (a request made right
    after the loop could find the node full). This wrapper, dropped with the loop, frees the
    slot at once; the generator's scheduled close then closes the connection.
    """

    __slots__ = ("_gen", "_stream")

    def __init__(self, stream: AsyncStream,
                 gen: AsyncGenerator[ChatCompletionChunk, None]) -> None:
        self._stream = stream
        self._gen = gen

    def __anext__(self) -> Coroutine[Any, Any, ChatCompletionChunk]:
        return self._gen.__anext__()

    def asend(self, value: None) -> Coroutine[Any, Any, ChatCompletionChunk]:
        return self._gen.asend(value)

    @overload
    def athrow(self, typ: type[BaseException], val: BaseException | object = None,
               tb: TracebackType | None = None, /) -> Coroutine[Any, Any, ChatCompletionChunk]:
        ...

    @overload
    def athrow(self, typ: BaseException, val: None = None, tb: TracebackType | None = None, /
               ) -> Coroutine[Any, Any, ChatCompletionChunk]:
        ...

    def athrow(self, typ: Any, val: Any = None, tb: Any = None, /
               ) -> Coroutine[Any, Any, ChatCompletionChunk]:
        if val is None and tb is None:
            return self._gen.athrow(typ)
        return self._gen.athrow(typ, val, tb)

    def aclose(self) -> Coroutine[Any, Any, None]:
        return self._gen.aclose()

    def __del__(self) -> None:
        state = self._stream._state
        if state is not None and not state.closed:
            state.closed = True
            state.call.ended(None)


_Opened = tuple[httpx2.Response, Any, StreamDecoder, "dict[str, Any] | None"]
"""An attempt whose answer has begun: the response, its event iterator, decoder, first chunk."""


def _open_sync(call: Call, http: httpx2.Client, wait: Callable[[Wait], None]) -> _StreamState:
    """Dispatch a stream (failover included) until its first chunk arrives."""

    def attempt(step: Step) -> _Opened:
        decoder = StreamDecoder(step.node.id)
        response: httpx2.Response | None = None
        try:
            request = http.build_request("POST", step.url, content=call.body,
                                         headers=call.headers, timeout=step.timeout)
            response = http.send(request, stream=True)
            if response.status_code >= 400:
                response.read()
                check_status(response.status_code, response.headers, response.content,
                             step.node.id)
            _answer_started(request, call)
            events = iter_events(response)
            return response, events, decoder, decoder.feed(_no_events(next(events, None), step))
        except BaseException as exc:
            if response is not None:
                response.close()
            if isinstance(exc, httpx2.HTTPError):
                raise stream_error(exc, decoder) from exc
            raise

    step, opened = drive(call, wait, attempt)
    return _started(call, step, opened)


async def _open_async(call: Call, http: httpx2.AsyncClient,
                      wait: Callable[[Wait], Awaitable[None]]) -> _StreamState:
    """:func:`_open_sync` for the async client."""

    async def attempt(step: Step) -> _Opened:
        decoder = StreamDecoder(step.node.id)
        response: httpx2.Response | None = None
        try:
            request = http.build_request("POST", step.url, content=call.body,
                                         headers=call.headers, timeout=step.timeout)
            response = await http.send(request, stream=True)
            if response.status_code >= 400:
                await response.aread()
                check_status(response.status_code, response.headers, response.content,
                             step.node.id)
            _answer_started(request, call)
            events = aiter_events(response)
            first = decoder.feed(_no_events(await anext(events, None), step))
            return response, events, decoder, first
        except BaseException as exc:
            if response is not None:
                await response.aclose()
            if isinstance(exc, httpx2.HTTPError):
                raise stream_error(exc, decoder) from exc
            raise

    step, opened = await adrive(call, wait, attempt)
    return _started(call, step, opened)


def _started(call: Call, step: Step, opened: _Opened) -> _StreamState:
    response, events, decoder, first = opened
    call.first_token(step)
    return _StreamState(call, step, response, events, decoder, first)


def _answer_started(request: httpx2.Request, call: Call) -> None:
    """The node answered (headers in): from here on, reads wait at most the idle timeout.

    The first-token timeout was the read timeout until now; the transport takes the body's
    read timeout from the request's ``timeout`` extension when the body is first read.
    """
    timeout = request.extensions.get("timeout")
    if isinstance(timeout, dict):
        timeout["read"] = call.idle_timeout()


def _mid_stream_error(state: _StreamState, exc: httpx2.HTTPError) -> NodeError | ZMLTimeoutError:
    deadline = state.call.deadline
    if isinstance(exc, httpx2.TimeoutException) and deadline is not None \
            and state.call.d.clock() >= deadline:
        return state.call.deadline_error(state.decoder)
    return stream_error(exc, state.decoder)


def _no_events(data: str | None, step: Step) -> str:
    if data is None:
        raise NodeConnectionError(
            f"node {step.node.id!r} closed the stream before sending any event",
            node_id=step.node.id,
        )
    return data



