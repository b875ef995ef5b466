"""Deadline watchdogs: a read never outlives its call's deadline, whatever the node sends.

A socket timeout bounds one read, not the call: a node that sends a byte (or an SSE keep-alive)
just often enough keeps every read short and the call alive past its deadline. So each client
keeps its calls' deadlines in a watchdog, which at a deadline shuts down the socket of every
response still watched: the blocked read returns at once (an error or the end of the body),
and the reader, seeing ``watch.fired``, raises ``ZMLTimeoutError``.

A call is watched from before its request is sent, so that the connect, the upload and the wait
for the response's headers (which a node can drip, or stretch with ``102 Processing``
interim responses) are bounded too: the watch starts on the *request*, whose ``network_stream``
extension zml's own transports fill in as soon as it goes out on a connection
(:mod:`zml.connections`), and :meth:`Watch.follow` moves it to the response once the headers are
in (with an ``http_client`` of your own, the wait for the headers is then bounded only by the
socket timeouts).

A watch may carry ``on_fire``, called right after its socket is shut down at the deadline (on
the watchdog's thread, or the loop, outside the watchdog's lock): an open stream frees its node
slot there, since the node drops the request when its connection closes, even while the caller
holds the stream without reading it (the call itself ends, with its ``ZMLTimeoutError``, when
the stream is next read or closed).

A call with no deadline is watched too, endlessly: closing the client shuts down every response
still watched, so a call in flight ends at once (with the closed-client error its driver raises,
see :mod:`zml.dispatch.drivers`) instead of waiting for the node.

* :class:`Watchdog` (one per :class:`zml.Client`): a daemon thread, started on the first call
  that needs it, that wakes at the earliest deadline it holds. A sync call ends within a few
  milliseconds of its deadline (thread wake-up latency).
* :class:`LoopWatchdog` (one per :class:`zml.AsyncClient`): one timer on the event loop at the
  earliest deadline, moved only for an earlier one. An async call ends within a few
  milliseconds of its deadline (event-loop latency).

Cost per call: one heap push (and, for the thread, one lock and a notification only when the
new deadline is the earliest); ending a call marks its entry done (no search). Entries of ended
calls are dropped when their deadline comes or when the heap holds more ended entries than
live ones.
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # asyncio is imported only by the async code paths (import time)
    import asyncio

__all__ = ["LoopWatchdog", "Watch", "Watchdog", "shutdown_socket"]


def shutdown_socket(response: Any) -> None:
    """Shut an HTTP response's socket down at once (both directions), without closing it:
    a read blocked on it returns, the node sees the disconnect, the transport cleans up.

    ``response`` may also be a request whose ``network_stream`` extension says which
    connection it is being sent on (nothing happens while it has none)."""
    extensions = getattr(response, "extensions", None)
    stream = None if extensions is None else extensions.get("network_stream")
    sock = None if stream is None else stream.get_extra_info("socket")
    if sock is None:
        return
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    except TypeError:
        # uvloop's transport sockets refuse shutdown(): shut the same socket down through a
        # duplicate of its descriptor (shutdown acts on the connection, not the descriptor).
        _shutdown_by_descriptor(sock)


def _shutdown_by_descriptor(sock: Any) -> None:
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        fd = sock.fileno()
        if fd < 0:
            return
        with socket.fromfd(fd, sock.family, sock.type) as dup:
            dup.shutdown(socket.SHUT_RDWR)


class Watch:
    """One watched response: :meth:`end` it once the call (or its read) is over."""

    __slots__ = ("deadline", "dog", "fired", "on_fire", "response")

    def __init__(self, dog: Watchdog | LoopWatchdog, deadline: float, response: Any) -> None:
        self.dog: Watchdog | LoopWatchdog = dog
        self.deadline: float = deadline
        self.response: Any = response
        """None once ended (the entry no longer keeps the response alive)."""
        self.fired: bool = False
        """True when the watchdog shut the response down at its deadline."""
        self.on_fire: Callable[[], object] | None = None
        """Called once the response was shut down at its deadline (not at a client's close)."""

    def end(self) -> None:
        """The call is over (or its read is): stop watching its response."""
        self.dog.end(self)

    def follow(self, response: Any) -> bool:
        """The response to the watched request arrived: watch it from now on. False if the
        watch had already fired (or ended): the deadline passed before the response came."""
        return self.dog.follow(self, response)


class _Heap:
    """Deadline entries ``(deadline, seq, watch)`` in a heap (compared in C), and how many
    are live; ended entries are dropped when they come first or outnumber the live ones."""

    __slots__ = ("entries", "live", "seq")

    def __init__(self) -> None:
        self.entries: list[tuple[float, int, Watch]] = []
        self.live = 0
        self.seq = itertools.count()

    def push(self, entry: Watch) -> bool:
        """Add ``entry``; whether it is now the earliest."""
        entries = self.entries
        earliest = not entries or entry.deadline < entries[0][0]
        heapq.heappush(entries, (entry.deadline, next(self.seq), entry))
        self.live += 1
        if len(entries) > 64 and len(entries) > 2 * self.live:
            self.entries = entries = [e for e in entries if e[2].response is not None]
            heapq.heapify(entries)
        return earliest

    def end(self, entry: Watch) -> None:
        if entry.response is not None:
            entry.response = None
            self.live -= 1

    def shut_all(self) -> None:
        """Shut down every live entry (the client is closing): not a deadline, so none of them
        is marked ``fired``."""
        entries, self.entries = self.entries, []
        self.live = 0
        for _, _, entry in entries:
            response, entry.response = entry.response, None
            if response is not None:
                shutdown_socket(response)

    def due(self, now: float, fired: list[Callable[[], object]]) -> float | None:
        """Shut down every live entry due at ``now`` (appending their ``on_fire`` callbacks
        to ``fired``, for the caller to run outside its lock); the next live deadline (None:
        none)."""
        entries = self.entries
        while entries:
            deadline, _, first = entries[0]
            if first.response is None:
                heapq.heappop(entries)
                continue
            if deadline > now:
                return deadline
            heapq.heappop(entries)
            response, first.response = first.response, None
            self.live -= 1
            first.fired = True
            shutdown_socket(response)
            if first.on_fire is not None:
                fired.append(first.on_fire)
        return None


def _run_callbacks(fired: list[Callable[[], object]]) -> None:
    for callback in fired:
        try:
            callback()
        except Exception:  # a watchdog must outlive what it calls
            logging.getLogger("zml").exception("zml: a deadline callback failed")
    fired.clear()


class Watchdog:
    """Shuts down the sockets of sync reads that outlive their deadline (module docs).

    ``clock`` is the clock deadlines are on (the dispatcher's, monotonic seconds).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._heap = _Heap()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, deadline: float, response: Any) -> Watch:
        """Shut ``response``'s socket down at ``deadline`` unless the watch ended before."""
        entry = Watch(self, deadline, response)
        with self._cond:
            if self._closed:  # a call that slipped past its client's close: already over
                entry.response = None
                return entry
            earliest = self._heap.push(entry)
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="zml-deadlines",
                                                daemon=True)
                self._thread.start()
            elif earliest:
                self._cond.notify()
        return entry

    def end(self, entry: Watch) -> None:
        """Stop watching ``entry`` (idempotent)."""
        if entry.response is None:
            return
        with self._cond:
            self._heap.end(entry)

    def follow(self, entry: Watch, response: Any) -> bool:
        """Watch ``response`` instead of what ``entry`` watched (see :meth:`Watch.follow`)."""
        with self._cond:
            if entry.response is None:
                return False
            entry.response = response
            return True

    def close(self) -> None:
        """Stop the thread and shut down every response still watched: the reads blocked on
        them return at once (the client is closing; its dispatcher says so to the readers)."""
        with self._cond:
            self._closed = True
            self._heap.shut_all()
            self._cond.notify()

    def _run(self) -> None:
        cond = self._cond
        clock = self._clock
        fired: list[Callable[[], object]] = []
        cond.acquire()
        try:
            while not self._closed:
                following = self._heap.due(clock(), fired)
                if fired:  # outside the lock: a callback may take others (the fleet's)
                    cond.release()
                    try:
                        _run_callbacks(fired)
                    finally:
                        cond.acquire()
                    continue
                if following is None or following == math.inf:  # none, or endless ones
                    cond.wait()
                else:  # no wait longer than the platform allows (it would raise, and stop us)
                    cond.wait(min(max(0.0, following - clock()), threading.TIMEOUT_MAX))
        finally:
            cond.release()


class LoopWatchdog:
    """The async clients' :class:`Watchdog`: the same watches, kept by the event loop.

    One per :class:`zml.AsyncClient`. It keeps a single loop timer, at the earliest deadline it
    holds, and moves it only for an earlier one: a call costs a heap push (no ``call_later``,
    whose cancelled handles would pile up in the loop's own timer heap), and its end marks the
    entry. At a deadline the socket of every response still watched is shut down, so the read
    in progress returns at once, and the reader, seeing ``watch.fired``, raises
    ``ZMLTimeoutError``. Not thread-safe: used from its client's event loop (ending a watch,
    which a finalizer may do from elsewhere, only marks it).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._heap = _Heap()
        self._timer: asyncio.TimerHandle | None = None
        self._timer_at = math.inf
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    def watch(self, deadline: float, response: Any) -> Watch:
        """Shut ``response``'s socket down at ``deadline`` unless the watch ended before."""
        from asyncio import get_running_loop

        entry = Watch(self, deadline, response)
        if self._closed:  # a call that slipped past its client's aclose: already over
            entry.response = None
            return entry
        self._heap.push(entry)
        loop = get_running_loop()
        if deadline < self._timer_at or loop is not self._loop:
            self._arm(loop, deadline)
        return entry

    def end(self, entry: Watch) -> None:
        """Stop watching ``entry`` (idempotent)."""
        self._heap.end(entry)

    def follow(self, entry: Watch, response: Any) -> bool:
        """Watch ``response`` instead of what ``entry`` watched (see :meth:`Watch.follow`)."""
        if entry.response is None:
            return False
        entry.response = response
        return True

    def close(self) -> None:
        """Stop the timer and shut down every response still watched (as
        :meth:`Watchdog.close`)."""
        self._closed = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._timer_at = math.inf
        self._heap.shut_all()

    def _arm(self, loop: asyncio.AbstractEventLoop, when: float) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._loop = loop
        self._timer_at = when
        if when != math.inf:  # an endless watch needs no timer
            self._timer = loop.call_later(max(0.0, when - self._clock()), self._fire)

    def _fire(self) -> None:
        self._timer = None
        self._timer_at = math.inf
        fired: list[Callable[[], object]] = []
        following = self._heap.due(self._clock(), fired)
        if following is not None and self._loop is not None and not self._loop.is_closed():
            self._arm(self._loop, following)
        _run_callbacks(fired)
