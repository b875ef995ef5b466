"""Deadline timers: a read never outlives its call's deadline, whatever the node sends.

A sync call reads from its socket in the caller's thread, and a socket timeout bounds one read,
not the call: a node that sends a byte (or an SSE keep-alive) just often enough keeps every read
short and the call alive past its deadline. An async call arms a timer on its event loop; a
sync one has no loop, so each :class:`zml.Client` has one :class:`Watchdog`: a daemon thread,
started on the first call that needs it, that wakes at the earliest deadline it holds and shuts
down the socket of every response still watched then. The blocked read returns at once (an
error or the end of the body), and the reader, seeing the deadline passed, raises
``ZMLTimeoutError``. So a sync call ends within a few milliseconds of its deadline (thread
wake-up latency), whatever the node sends.

:class:`TaskTimer` is the async clients' counterpart: a timer on the event loop that cancels
the task reading (a stream's, or a non-streamed call's body read) when the deadline passes.

Cost per call: one lock, one heap push, and a notification only when the new deadline is the
earliest; ending a call marks its entry done (no search). Entries of ended calls are dropped
when their deadline comes or when the heap holds more ended entries than live ones. (A timer
on the loop costs one ``call_later``.)
"""

from __future__ import annotations

import contextlib
import heapq
import itertools
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # asyncio is imported only by the async code paths (import time)
    import asyncio

__all__ = ["TaskTimer", "Watch", "Watchdog", "shutdown_socket"]


def shutdown_socket(response: Any) -> None:
    """Shut an HTTP response's socket down at once (both directions), without closing it:
    a read blocked on it returns, the node sees the disconnect, the transport cleans up."""
    extensions = getattr(response, "extensions", None)
    stream = None if extensions is None else extensions.get("network_stream")
    sock = None if stream is None else stream.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


class Watch:
    """One watched response: :meth:`Watchdog.end` (or :meth:`end`) it once the call is over."""

    __slots__ = ("deadline", "dog", "fired", "response", "seq")

    def __init__(self, dog: Watchdog, deadline: float, seq: int, response: Any) -> None:
        self.dog: Watchdog = dog
        self.deadline: float = deadline
        self.seq: int = seq
        self.response: Any = response
        """None once ended (the entry no longer keeps the response alive)."""
        self.fired: bool = False
        """True when the watchdog shut the response down at its deadline."""

    def __lt__(self, other: Watch) -> bool:
        return (self.deadline, self.seq) < (other.deadline, other.seq)

    def end(self) -> None:
        """The call is over (or its read is): stop watching its response."""
        self.dog.end(self)


class Watchdog:
    """Shuts down the sockets of sync reads that outlive their deadline (module docs).

    ``clock`` is the clock deadlines are on (the dispatcher's, monotonic seconds).
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[Watch] = []
        self._live = 0
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False

    def watch(self, deadline: float, response: Any) -> Watch:
        """Shut ``response``'s socket down at ``deadline`` unless the watch ended before."""
        with self._cond:
            entry = Watch(self, deadline, next(self._seq), response)
            heap = self._heap
            earliest = not heap or entry < heap[0]
            heapq.heappush(heap, entry)
            self._live += 1
            if len(heap) > 64 and len(heap) > 2 * self._live:
                self._heap = heap = [e for e in heap if e.response is not None]
                heapq.heapify(heap)
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
            if entry.response is not None:
                entry.response = None
                self._live -= 1

    def close(self) -> None:
        """Stop the thread; responses still watched are left to their own timeouts."""
        with self._cond:
            self._closed = True
            self._cond.notify()

    def _run(self) -> None:
        cond = self._cond
        clock = self._clock
        with cond:
            while not self._closed:
                heap = self._heap
                if not heap:
                    cond.wait()
                    continue
                first = heap[0]
                if first.response is None:
                    heapq.heappop(heap)
                    continue
                delay = first.deadline - clock()
                if delay > 0:
                    cond.wait(delay)
                    continue
                heapq.heappop(heap)
                response, first.response = first.response, None
                self._live -= 1
                first.fired = True
                shutdown_socket(response)


class TaskTimer:
    """An async call's deadline timer: interrupts the read in progress when it fires.

    The async counterpart of :class:`Watchdog`, on the event loop. Held by the stream (or the
    call) and by the loop's timer, never referring back to the stream, so a dropped stream is
    collected at once. Between reads ``reader`` is None and a firing timer only marks it
    expired (the next read raises).
    """

    __slots__ = ("expired", "handle", "reader")

    def __init__(self) -> None:
        self.expired: bool = False
        self.reader: asyncio.Task[Any] | None = None
        self.handle: asyncio.TimerHandle | None = None

    def arm(self, delay: float) -> None:
        """Fire in ``delay`` seconds (re-arming replaces the previous deadline)."""
        from asyncio import get_running_loop

        self.disarm()
        self.expired = False
        self.handle = get_running_loop().call_later(max(0.0, delay), self._fire)

    def disarm(self) -> None:
        """Do not fire."""
        handle = self.handle
        if handle is not None:
            self.handle = None
            handle.cancel()

    def _fire(self) -> None:
        self.handle = None
        self.expired = True
        reader = self.reader
        if reader is not None:
            reader.cancel()

    def own(self, exc: asyncio.CancelledError) -> bool:
        """Whether a CancelledError in a read came from this timer (and only from it)."""
        reader = self.reader
        if not self.expired or reader is None:
            return False
        if sys.version_info >= (3, 11):
            reader.uncancel()
            return reader.cancelling() == 0
        return True
