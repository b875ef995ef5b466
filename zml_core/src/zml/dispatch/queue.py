"""The saturation queue: requests of a ``queue_on_saturation`` policy waiting for a slot.

One FIFO per (policy, model), so "is someone for this model ahead of me" is a look at the
head, and waking is O(1): when a slot frees, only the request at the head of each queue is
woken (it routes again; if it gets the slot it leaves the queue and wakes the next one). The
others sleep until they are first in line or their queue deadline passes, so draining N queued
requests costs O(N) wake-ups, not O(N²).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

__all__ = ["QUEUE_LIMIT", "QUEUE_RECHECK_S", "SaturationQueues", "Ticket"]

QUEUE_LIMIT = 1024
"""Requests one policy may have queued at once; the next one gets ``queue_full``."""

QUEUE_RECHECK_S = 0.25
"""How often the head of a queue routes again without a wake-up (load reported by nodes'
``/metrics`` can fall without any slot of this process being released)."""


class Ticket:
    """A request's place in a saturation queue, and the way to wake it."""

    __slots__ = ("_lock", "_pending", "_waker", "key", "queued")

    def __init__(self, key: tuple[str, str]) -> None:
        self.key: tuple[str, str] = key
        """(policy name, model)."""
        self.queued: bool = False
        """Whether the ticket is in its queue now."""
        self._lock = threading.Lock()
        self._waker: Callable[[], None] | None = None
        self._pending = False

    def wake(self) -> None:
        """End the request's current wait (or its next one, if it is not waiting yet)."""
        with self._lock:
            waker = self._waker
            if waker is None:
                self._pending = True
                return
        waker()

    def arm(self, waker: Callable[[], None]) -> None:
        """The driver starts waiting: ``waker`` ends the wait (called at once if a wake-up
        came in between)."""
        with self._lock:
            if self._pending:
                self._pending = False
                fire = True
            else:
                self._waker = waker
                fire = False
        if fire:
            waker()

    def disarm(self) -> None:
        """The driver stopped waiting."""
        with self._lock:
            self._waker = None
            self._pending = False


class SaturationQueues:
    """Every saturation queue of one dispatcher, keyed by (policy name, model)."""

    def __init__(self, lock: Any) -> None:
        self._lock = lock  # the fleet's lock: queue order and routing decisions change together
        self._queues: dict[tuple[str, str], dict[Ticket, None]] = {}
        self._per_policy: dict[str, int] = {}

    def depth(self, policy: str) -> int:
        """Requests queued for ``policy`` (every model)."""
        return self._per_policy.get(policy, 0)

    def queued(self, policy: str) -> list[Ticket]:
        """The tickets queued for ``policy``, oldest first within each model."""
        with self._lock:
            return [t for key, q in self._queues.items() if key[0] == policy for t in q]

    def ahead(self, ticket: Ticket) -> bool:
        """Whether a request for the same model queued before ``ticket`` (one not in the queue
        is behind every queued one)."""
        queue = self._queues.get(ticket.key)
        if not queue:
            return False
        return next(iter(queue)) is not ticket

    def join(self, ticket: Ticket) -> int:
        """Add ``ticket`` at the back; return the policy's queue depth with it, or 0 when the
        policy already has QUEUE_LIMIT queued (nothing is added)."""
        policy = ticket.key[0]
        with self._lock:
            depth = self._per_policy.get(policy, 0)
            if depth >= QUEUE_LIMIT:
                return 0
            self._queues.setdefault(ticket.key, {})[ticket] = None
            self._per_policy[policy] = depth + 1
            ticket.queued = True
        return depth + 1

    def leave(self, ticket: Ticket) -> None:
        """Remove ``ticket`` (if queued); wake the new head when it was first in line."""
        with self._lock:
            queue = self._queues.get(ticket.key)
            if queue is None or ticket not in queue:
                return
            was_head = next(iter(queue)) is ticket
            del queue[ticket]
            ticket.queued = False
            self._per_policy[ticket.key[0]] -= 1
            head = next(iter(queue), None) if was_head else None
            if not queue:
                del self._queues[ticket.key]
        if head is not None:
            head.wake()

    def wake_all(self) -> None:
        """Wake every queued request (its client is closing)."""
        with self._lock:
            tickets = [t for q in self._queues.values() for t in q]
        for ticket in tickets:
            ticket.wake()

    def wake_heads(self) -> None:
        """Capacity may have freed: wake the first request of each queue."""
        with self._lock:
            heads = [next(iter(q)) for q in self._queues.values() if q]
        for head in heads:
            head.wake()
