"""The :class:`zml.ledger.SlotLedger` of one client: slot leases held in Redis.

Each node has a sorted set of leases, ``{prefix}:lease:{node_id}``, member the lease id,
score its expiry (Redis's clock, ms). Acquiring is one script (:data:`scripts.ACQUIRE`): drop
expired leases, count, add if fewer than ``max_concurrency + max_queue`` are held. The count it
returns becomes the node's reported load in this client at once, so routing here sees what
every process holds. A lease lives ``ZML_REDIS_LEASE_TTL_S`` (10 s) unless renewed, and the
hub renews those its process holds every third of that: a process that dies (``kill -9``)
gives its slots back within one TTL.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

from zml.fleet import Fleet, NodeState

from .hub import Hub

__all__ = ["RedisLedger"]


class RedisLedger:
    """A cross-process slot ledger over a :class:`~zml_redis.hub.Hub` (one per client fleet).

    ``acquire``/``aacquire`` cost one round trip to Redis; when Redis is unreachable they
    answer True at once (the process falls back to its own accounting). ``release`` only
    queues the deletion for the hub's worker thread: it never blocks and never raises.
    """

    def __init__(self, hub: Hub, fleet: Fleet) -> None:
        self.hub = hub
        self._fleet = fleet
        self._keys = {node: hub.settings.lease_key(node.id) for node in fleet}
        hub.attach(self)

    def __repr__(self) -> str:
        return f"RedisLedger({self.hub!r}, nodes={len(self._keys)})"

    @property
    def fleet(self) -> Fleet:
        """The client's fleet (fed with global loads and other processes' health events)."""
        return self._fleet

    @property
    def keys(self) -> Mapping[NodeState, str]:
        """Each node of the fleet with its lease key."""
        return self._keys

    def _key(self, node: NodeState) -> str:
        key = self._keys.get(node)
        return key if key is not None else self.hub.settings.lease_key(node.id)

    def acquire(self, node: NodeState, lease_id: str) -> bool:
        """Take a lease on ``node`` if fewer than its capacity are held (by every process)."""
        return self.hub.acquire(node, self._key(node), node.max_concurrency + node.max_queue,
                                lease_id)

    async def aacquire(self, node: NodeState, lease_id: str) -> bool:
        """As :meth:`acquire`, for async clients."""
        return await self.hub.aacquire(node, self._key(node),
                                       node.max_concurrency + node.max_queue, lease_id)

    def release(self, node: NodeState, lease_id: str) -> None:
        """Give the lease back (queued for the worker thread; never blocks or raises)."""
        with contextlib.suppress(Exception):  # a ledger must never fail a request
            self.hub.release(self._key(node), lease_id)
