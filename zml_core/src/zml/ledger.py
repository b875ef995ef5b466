"""Slot leases shared between processes: the seam that a shared-state plugin fills.

Within one process, :mod:`zml.fleet` never oversubscribes a node: slots are reserved under a
lock at decision time. Across processes (replicas of a service) that is not enough: each
believes the node has room. A :class:`SlotLedger` is an external, atomic count of the slots
every process holds, with leases that expire so a crashed process cannot hold capacity forever.

Dispatch uses it in two steps: the local reservation first (so this process stays honest and
the routing decision stays I/O-free), then ``acquire`` of a lease from the ledger, by the
driver (sync or async, one call). A refused lease releases the local slot, marks the node full
in this process's view until the ledger's next load report, and routes again. ``release`` is
called on every path that frees the local slot; it must not block (hand the work to a
background thread or task) and must not raise.

Without a ledger (the default) none of this costs anything. The ``zml-redis`` plugin provides
one; a ledger that loses its backing store should answer ``True`` (fall back to local state)
rather than fail requests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from .fleet import NodeState

__all__ = ["SlotLedger"]


class SlotLedger(Protocol):
    """An atomic, cross-process count of the slots held on each node."""

    def acquire(self, node: NodeState, lease_id: str) -> bool:
        """Take a lease on ``node`` if fewer than ``max_concurrency + max_queue`` are held
        (sync clients). True: granted (or the store is unreachable); False: the node is full."""
        ...

    async def aacquire(self, node: NodeState, lease_id: str) -> bool:
        """As :meth:`acquire`, for async clients."""
        ...

    def release(self, node: NodeState, lease_id: str) -> None:
        """Give the lease back. Must not block or raise."""
        ...
