"""Dispatch: one logical request, from its arguments to exactly one response or one error.

The layer is split by what each part is, so that the attempt loop is written once and can
run under any clock:

================  ===========================================================================
``request.py``    :class:`Request` — frozen: what the caller asked (and :class:`Timeouts`)
``record.py``     :class:`Record` — what happened: attempts, nodes tried, queueing, outcome
``ops.py``        the operations a flow yields (Now, Reserve, Release, Mark, Notify, Enqueue,
                  Dequeue, Wait, Lease, Send) and what Reserve answers
``flow.py``       :func:`attempt_flow` and the endings — the decisions, with no effects; the
                  failover rules are in its docstring
``effects.py``    :class:`Effects` — carries out the common operations (fleet, clock, plugins)
``queue.py``      the saturation queue (O(1) wake-ups)
``drivers.py``    :func:`drive` (blocking) and :func:`adrive` (``await``), and :class:`Call`
``view.py``       :class:`CallView` — what plugins see of a request (read-only)
``dispatcher.py`` :class:`Dispatcher` — validates requests, owns the effects
================  ===========================================================================

Replay (:mod:`zml.sim.replay`) adds a third driver that runs the same flows in virtual time.
"""

from __future__ import annotations

from .dispatcher import Dispatcher
from .drivers import Call, CallStopped, adrive, drive
from .effects import Effects
from .flow import (
    FINAL_ERRORS,
    MAX_ATTEMPTS,
    RETRY_AFTER_MAX_S,
    FlowSettings,
    attempt_flow,
    broke_flow,
    end_flow,
    success_flow,
)
from .ops import (
    Behind,
    Dequeue,
    Enqueue,
    Lease,
    Mark,
    Notify,
    Now,
    Operation,
    Release,
    Reserve,
    Reserved,
    Saturated,
    Send,
    Wait,
)
from .queue import QUEUE_LIMIT, QUEUE_RECHECK_S, Ticket
from .record import Record, ResponseSummary, Step
from .request import OPENAI_PARAMS, Request, Timeouts, validate_messages
from .view import CallView

__all__ = [
    "FINAL_ERRORS",
    "MAX_ATTEMPTS",
    "OPENAI_PARAMS",
    "QUEUE_LIMIT",
    "QUEUE_RECHECK_S",
    "RETRY_AFTER_MAX_S",
    "Behind",
    "Call",
    "CallStopped",
    "CallView",
    "Dequeue",
    "Dispatcher",
    "Effects",
    "Enqueue",
    "FlowSettings",
    "Lease",
    "Mark",
    "Notify",
    "Now",
    "Operation",
    "Record",
    "Release",
    "Request",
    "Reserve",
    "Reserved",
    "ResponseSummary",
    "Saturated",
    "Send",
    "Step",
    "Ticket",
    "Timeouts",
    "Wait",
    "adrive",
    "attempt_flow",
    "broke_flow",
    "drive",
    "end_flow",
    "success_flow",
    "validate_messages",
]
