"""What happened to a request: the :class:`Record` its flow keeps, and each attempt's :class:`Step`.

The request itself (:class:`.request.Request`) is frozen; the record is the only thing that
changes while it is dispatched, and only the flow (:mod:`.flow`) writes it. Plugins see it
through a read-only view (:mod:`.view`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from ..errors import NodeError
    from ..fleet import NodeState, Reservation
    from ..types import Attempt, RoutingInfo
    from .queue import Ticket

__all__ = ["Record", "ResponseSummary", "Step"]


class ResponseSummary(NamedTuple):
    """What telemetry needs of a finished answer: the node's id and model, the finish reason
    (the first choice's) and each choice's (in index order, for ``n > 1``)."""

    id: str | None
    model: str | None
    finish_reason: str | None
    finish_reasons: tuple[str, ...] = ()


@dataclass
class Step:
    """One attempt: the request goes to ``node``, whose slot ``reservation`` holds.

    ``timeout`` is the attempt's transport timeout (none beyond the overall deadline), the
    ``timeout`` request extension itself (a stream's read timeout changes in it once its
    answer started);
    ``sent_at`` and ``first_token_at`` are set as the attempt goes (the dispatcher's clock).
    """

    node: NodeState
    reservation: Reservation
    routing: RoutingInfo
    url: str
    timeout: dict[str, float | None]
    sent_at: float = 0.0
    first_token_at: float | None = None
    explained_ms: float = 0.0
    """The part of the predicted TTFT routing explained (prefill, requests ahead; see
    ``zml.routing.Decision.base_ttft_ms``), taken out of the observed TTFT the fleet learns."""
    sent_headers: Mapping[str, str] | None = None
    """The headers the attempt's request went out with (plugins' and the HTTP client's
    defaults included): what errors are scrubbed of (:func:`zml.errors.credentials`)."""
    scrub_answer: Callable[[dict[str, Any]], None] | None = None
    """Once the attempt answered: what takes its credentials out of its answer's metadata
    (:func:`zml.errors.answer_scrubber`), for the chunks of a stream as they are read; None
    when it sent none."""


@dataclass
class Record:
    """The request's history: failed attempts, nodes tried, queueing, the outcome.

    Attributes:
        attempts: the failed attempts, in order (also in ``routing.attempts``).
        tried: ids of nodes already tried (excluded when routing again).
        retry_at: node id -> when a rate-limited node may be tried again.
        last_error: the last node error (the cause of ``attempts_exhausted``).
        queued_at: when the request joined the saturation queue (None: never queued).
        queue_deadline: when it gives up waiting there (None: no limit).
        trace: the last routing trace (``evaluated``), for errors that follow it.
        current: the attempt under way (or the one that answered).
        outcome: ``"completed"``, ``"failed"`` or ``"cancelled"`` once the request ended.
        response: the answer's summary, once it completed.
        ticket: the request's saturation-queue ticket, once its policy queued it.
        state: scratch space for plugins (a telemetry span, say), per request.
        sent: how many attempts went out to a node (the failed ones, and the one under way or
            that answered).
    """

    attempts: list[Attempt] = field(default_factory=list)
    tried: set[str] = field(default_factory=set)
    retry_at: dict[str, float] = field(default_factory=dict)
    last_error: NodeError | None = None
    queued_at: float | None = None
    queue_deadline: float | None = None
    trace: list[dict[str, Any]] = field(default_factory=list)
    current: Step | None = None
    outcome: str | None = None
    response: ResponseSummary | None = None
    ticket: Ticket | None = None
    state: dict[str, Any] = field(default_factory=dict)
    sent: int = 0

    @property
    def ended(self) -> bool:
        """Whether the request has ended (one way or another)."""
        return self.outcome is not None

    @property
    def ttft_s(self) -> float | None:
        """Seconds from sending to the first token of the attempt that answered, once known."""
        step = self.current
        if step is None or step.first_token_at is None:
            return None
        return step.first_token_at - step.sent_at
