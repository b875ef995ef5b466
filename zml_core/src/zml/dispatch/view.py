"""What plugins see of a request: a read-only view of the request and its record.

Every telemetry and cost hook receives a :class:`CallView` as ``call``. It shows what was
asked and what has happened so far, and nothing that lets a plugin change how the request is
dispatched; ``state`` is the one writable part, a scratch dict for plugins (a span, a timer),
under keys each plugin owns.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..ledger import SlotLedger
    from ..policy import Policy
    from ..types import Attempt
    from .record import Record, ResponseSummary
    from .request import Request

__all__ = ["CallView"]


class CallView:
    """A read-only view of one request, for plugins."""

    __slots__ = ("_clock", "_ledger", "_record", "_request")

    def __init__(self, request: Request, record: Record, clock: Callable[[], float],
                 ledger: SlotLedger | None) -> None:
        self._request = request
        self._record = record
        self._clock = clock
        self._ledger = ledger

    def __repr__(self) -> str:
        return (f"CallView(model={self.model!r}, policy={self.policy_name!r}, "
                f"stream={self.stream}, attempts={len(self._record.attempts)})")

    @property
    def model(self) -> str:
        """The model asked for."""
        return self._request.model

    @property
    def policy(self) -> Policy | None:
        """The request's policy, or None."""
        return self._request.policy

    @property
    def policy_name(self) -> str | None:
        """The policy's name, or None."""
        return self._request.policy_name

    @property
    def accelerator(self) -> str | None:
        """The pinned family (``accelerator=``), or None."""
        return self._request.accelerator

    @property
    def stream(self) -> bool:
        """Whether the answer is streamed."""
        return self._request.stream

    @property
    def metadata(self) -> Mapping[str, Any]:
        """The caller's ``metadata={...}`` labels (read-only)."""
        return self._request.metadata

    @property
    def body(self) -> bytes:
        """The encoded request body, prompt included: record it only if the user opted in."""
        return self._request.body

    @property
    def started_at(self) -> float:
        """When the request was made (monotonic seconds, the client's clock)."""
        return self._request.started_at

    @property
    def elapsed_s(self) -> float:
        """Seconds since the request was made."""
        return self._clock() - self._request.started_at

    @property
    def attempts(self) -> tuple[Attempt, ...]:
        """The failed attempts so far (an attempt that fails after its answer started, which
        is not retried, is not among them: see :attr:`sent`)."""
        return tuple(self._record.attempts)

    @property
    def sent(self) -> int:
        """How many attempts went out to a node so far: the failed ones, and the one under way
        or that answered (``1 + failovers`` once the request ended, however it ended)."""
        return self._record.sent

    @property
    def response(self) -> ResponseSummary | None:
        """The answer's id, model and finish reason, once it completed."""
        return self._record.response

    @property
    def ttft_s(self) -> float | None:
        """Seconds from sending to the first token of the attempt that answered, once known."""
        return self._record.ttft_s

    @property
    def first_chunk_s(self) -> float | None:
        """Seconds from the request being made (``started_at``) to the first chunk of its answer,
        queueing and failed attempts included: what the caller waited; once known."""
        step = self._record.current
        if step is None or step.first_token_at is None:
            return None
        return step.first_token_at - self._request.started_at

    @property
    def ledger(self) -> SlotLedger | None:
        """The client's cross-process slot ledger, if a plugin installed one."""
        return self._ledger

    @property
    def state(self) -> dict[str, Any]:
        """Scratch space for plugins, per request (use keys your plugin owns)."""
        return self._record.state
