"""The operations an attempt flow yields: what it asks its driver to do, as plain values.

The flow (:mod:`.flow`) never reads a clock, touches fleet state, calls a plugin, sleeps or
sends: it yields one of these and receives the result. Most are carried out the same way by
every driver (:class:`~.effects.Effects`); :class:`Wait`, :class:`Lease` and :class:`Send` are
what differs between the blocking, the ``await`` and the virtual-clock driver.

=================  ==========================================  ==============================
operation          what the driver does                        what the flow receives
=================  ==========================================  ==============================
``Now()``          reads the clock                             seconds (float)
``Reserve(...)``   routes and reserves a slot, atomically      ``Reserved`` | ``Behind`` |
                                                               ``Saturated`` |
                                                               ``routing.NoRoute``
``Release(...)``   gives a slot back (``refused``: the ledger  None
                   said the node is full)
``Mark(...)``      records a node's success or failure         None
``Notify(...)``    calls a plugin hook                         the hook's result
``Enqueue(...)``   joins the policy's saturation queue         the depth, 0 when it is full
``Dequeue(...)``   leaves it                                   None
``Wait(...)``      sleeps until ``until`` (or a queue wake-up) None
``Lease(...)``     asks the cross-process ledger for a lease   bool (granted)
``Send(...)``      sends the attempt                           the answer, or the NodeError
=================  ==========================================  ==============================

They are NamedTuples rather than frozen dataclasses: as immutable, several times cheaper to
define at import and to build (a request builds about ten). Drivers tell them apart by type.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from .. import routing
    from ..fleet import NodeState, Reservation
    from .queue import Ticket
    from .record import Step
    from .request import Request

__all__ = [
    "Behind",
    "Dequeue",
    "Enqueue",
    "Lease",
    "Mark",
    "Notify",
    "Now",
    "Operation",
    "Release",
    "Reserve",
    "Reserved",
    "Saturated",
    "Send",
    "Wait",
]


class Now(NamedTuple):
    """Read the clock."""


class Reserve(NamedTuple):
    """Route ``request`` (excluding ``exclude``) and reserve the chosen node's slot, in one
    critical section; ``ticket``: the request's place in a saturation queue, if its policy
    queues (requests queued earlier for the same model come first)."""

    request: Request
    exclude: frozenset[str]
    now: float
    ticket: Ticket | None


class Reserved(NamedTuple):
    """A slot was reserved: the decision, the reservation, how long deciding took (µs), and
    (for a non-streamed request) whether the policy's chain has an untried node of the model
    in a family after the chosen one: somewhere a failed attempt could still go."""

    decision: routing.Decision
    reservation: Reservation
    decision_us: float
    fallback: bool = False


class Behind(NamedTuple):
    """Requests queued earlier for the same model, which freed capacity could serve, come
    first: wait behind them."""

    trace: tuple[dict[str, Any], ...]


class Saturated(NamedTuple):
    """No node can take the request now, but freed capacity could (a node it may use is full
    or over the latency limit only for the work already on it, and idle would take it): a
    request whose policy queues may wait for a slot. (A ``routing.NoRoute`` result is one no freed slot can cure: its own
    prompt puts every idle node over the limit, no node serves the model, every node is
    unhealthy, circuit-open or already tried.)"""

    decision: routing.NoRoute


class Release(NamedTuple):
    """Give ``reservation``'s slot back (``refused``: the ledger refused its lease at ``now``)."""

    reservation: Reservation
    refused: bool = False
    now: float = 0.0


class Mark(NamedTuple):
    """Record an outcome on ``node``: a success (with its latencies) or a node-side failure."""

    node: NodeState
    ok: bool
    now: float
    ttft_s: float | None = None
    service_s: float | None = None
    explained_ms: float = 0.0


class Notify(NamedTuple):
    """Call the plugin hook ``hook`` with ``kwargs`` (failures are isolated, never raised)."""

    hook: str
    kwargs: Mapping[str, Any]


class Enqueue(NamedTuple):
    """Join the back of ``ticket``'s saturation queue."""

    ticket: Ticket


class Dequeue(NamedTuple):
    """Leave ``ticket``'s saturation queue (the next request in it may route now)."""

    ticket: Ticket


class Wait(NamedTuple):
    """Wait until ``until`` (the dispatcher's clock); with a ``ticket``, a queue wake-up (a
    slot freed and this request is first in line) ends the wait early."""

    until: float
    ticket: Ticket | None = None

    @property
    def for_capacity(self) -> bool:
        """Whether freed capacity ends the wait early."""
        return self.ticket is not None


class Lease(NamedTuple):
    """Ask the cross-process ledger for a lease on ``step``'s node (the driver picks the lease
    id and records it on the reservation when granted)."""

    step: Step


class Send(NamedTuple):
    """Send the request on ``step``; the result is the answer, or the NodeError it raised."""

    step: Step


Operation = Now | Reserve | Release | Mark | Notify | Enqueue | Dequeue | Wait | Lease | Send
"""What an attempt flow asks its driver to do."""
