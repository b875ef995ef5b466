"""The attempt loop, written once, as generators that perform no effects.

:func:`attempt_flow` yields operations (:mod:`.ops`: read the clock, reserve or release a
slot, mark a node, notify plugins, join or leave the saturation queue, wait, lease, send) and
receives their results; it writes only the request's :class:`~.record.Record`. The endings
(:func:`success_flow`, :func:`broke_flow`, :func:`end_flow`) are flows too. Drivers
(:mod:`.drivers`) carry the operations out: blocking, with ``await``, or in virtual time.

Failover rules (the contract):

* A retryable failure (connection refused/reset, timeout before the first byte, 429, 500, 502,
  503, 504) *before the first token reached the caller* marks the node (health, circuit) and
  routes again, excluding the nodes already tried, up to ``max_attempts`` dispatches within the
  request's deadline. Every failed attempt is listed in ``routing.attempts``.
* 429 honours ``Retry-After`` (capped at ``RETRY_AFTER_MAX_S``): the node is skipped until
  then; if it is the only candidate left and the time falls within the deadline, the call
  waits and tries it again. Rate limiting is load, not ill health: the node is not marked.
* A failure that is not the node's doing (``NodeError.node_fault`` False: a bad header value
  from this client, say) and 400, 401, 403, 404, 422 (and other 4xx) are never retried: the
  typed error is raised at once, and the node is not marked. A protocol violation (a
  malformed answer, a redirect, a body too deep or too large) is not retried either (the node
  may have done the work), but it is the node's doing: the node is marked.
* After the first token, nothing is retried: a broken stream raises IncompleteStreamError.
* When attempts run out, :class:`RoutingError` with ``final_error`` ``"attempts_exhausted"``
  (context key ``attempts``), chained from the last node error.
* A non-streamed attempt waits at most ``first_token`` (when set) or, when routing saw other
  candidates, the time left divided by the attempts left (but no less than twice the node's
  usual service time), so that a stalled node fails over before the deadline.
* A timeout at the request's own deadline (the attempt had all the time left) is the caller's
  budget running out, not the node failing: the node is not marked, it is not listed in
  ``attempts``, and the request ends with ZMLTimeoutError.

Saturation queue (``queue_on_saturation``): a request that finds no node waits in its
policy's queue only when freed capacity could serve it (:class:`~.ops.Saturated`: a node it
may use is full, or over the latency limit only for the work on it); otherwise (its own prompt
puts every idle node over the limit, no node serves the model, every node is unhealthy,
circuit-open or tried) it fails at once with ``no_viable_node``, queued or not. Requests that
wait are served first come, first served (:class:`~.ops.Behind`); one that joins the queue
routes again at once, so a slot freed while it was joining is not missed.

``final_error`` values: ``no_viable_node`` (routing found no node), ``queue_timeout`` (waited
``max_queue_ms`` in the saturation queue; when the request's deadline ends the wait first, it
is the deadline's ZMLTimeoutError, which says so), ``queue_full`` (the saturation queue is at
``QUEUE_LIMIT``), ``attempts_exhausted`` (every attempt failed).
"""

from __future__ import annotations

import math
from collections.abc import Generator, Mapping
from typing import Any, NamedTuple

from .. import routing
from ..errors import (
    NodeError,
    NodeStatusError,
    NodeTimeoutError,
    RateLimitError,
    RoutingError,
    ZMLError,
    ZMLTimeoutError,
)
from ..transport import RETRY_AFTER_MAX_S
from ..types import Attempt, Cost, RoutingInfo, trusted
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
from .request import Request

__all__ = [
    "FINAL_ERRORS",
    "MAX_ATTEMPTS",
    "RETRY_AFTER_MAX_S",
    "FlowSettings",
    "attempt_flow",
    "broke_flow",
    "end_flow",
    "success_flow",
]

MAX_ATTEMPTS = 3
FINAL_ERRORS = ("no_viable_node", "queue_timeout", "queue_full", "attempts_exhausted")
_DEADLINE_SLACK_S = 0.005  # an attempt timed out at the deadline (timers fire a hair early)

Flow = Generator[Operation, Any, Any]


class FlowSettings(NamedTuple):
    """What a flow needs of its dispatcher: attempt limit, whether a ledger leases slots,
    and the family profiles' prior TTFTs (none: routing's global prior)."""

    max_attempts: int = MAX_ATTEMPTS
    leases: bool = False


def attempt_flow(
    req: Request, rec: Record, settings: FlowSettings
) -> Generator[Operation, Any, tuple[Step, Any]]:
    """Route, reserve, lease, send and fail over until an attempt answers.

    Returns the step that answered and what its send returned. Raises RoutingError,
    ZMLTimeoutError or the node's non-retryable error; the driver then runs :func:`end_flow`.
    """
    ticket = rec_ticket(req, rec)
    behind = False  # whether the last wait in the queue was behind others
    while True:
        now = yield Now()
        _check_deadline(req, rec, now, behind)
        if ticket is not None and ticket.queued and rec.queue_deadline is not None \
                and now >= rec.queue_deadline:
            raise _queue_timeout(req, rec, now, behind)
        result = yield Reserve(req, frozenset(rec.tried), now, ticket)
        if isinstance(result, Behind):
            behind = True
            if result.trace:
                rec.trace = list(result.trace)
            if ticket is not None and not ticket.queued:
                yield from _enqueue(req, rec, now, _context(req, rec, "queue_full"))
                continue  # in line now: look again (the head may have left in between)
            yield Wait(_behind_until(req, rec), ticket)
            continue
        if isinstance(result, Saturated | routing.NoRoute):
            behind = False
            no_route = result.decision if isinstance(result, Saturated) else result
            rec.trace = [e.as_dict() for e in no_route.evaluated]
            wait = yield from _no_route(req, rec, no_route, now, isinstance(result, Saturated))
            if wait is not None:
                yield wait
            continue
        assert isinstance(result, Reserved)
        step = _step(req, rec, result, now, settings)
        rec.current = step
        rec.tried.add(step.node.id)
        if settings.leases:
            granted = yield Lease(step)
            if not granted:  # the node is full elsewhere: never sent to, never "routed"
                yield Release(step.reservation, refused=True, now=now)
                rec.tried.discard(step.node.id)
                rec.current = None
                continue
        yield Notify("zml_request_routed", {"routing": step.routing})
        if ticket is not None and ticket.queued:
            yield Dequeue(ticket)  # the next request for this model may route now
        step.sent_at = yield Now()
        rec.sent += 1
        outcome = yield Send(step)
        if isinstance(outcome, NodeError):
            yield from _failed(req, rec, step, outcome, settings)
            continue
        return step, outcome


def rec_ticket(req: Request, rec: Record) -> Ticket | None:
    """The request's saturation-queue ticket (kept in the record), if its policy queues."""
    policy = req.policy
    if policy is None or not policy.queue_on_saturation:
        return None
    if rec.ticket is None:
        rec.ticket = Ticket((policy.name, req.model))
    return rec.ticket


def _step(req: Request, rec: Record, reserved: Reserved, now: float,
          settings: FlowSettings) -> Step:
    decision = reserved.decision
    node = reserved.reservation.node
    load = node.load - 1  # the load before this reservation
    # Every field named, in field order: what RoutingInfo.model_construct(...) builds, for
    # less (this runs once per attempt).
    info = trusted(RoutingInfo, {
        "node_id": node.id,
        "accelerator": node.family,
        "policy": req.policy_name,
        "queue_depth": max(0, load - node.max_concurrency),
        "node_load": load,
        "predicted_ttft_ms": decision.predicted_ttft_ms,
        "evaluated": [e.as_dict() for e in decision.evaluated],
        "decision_us": round(reserved.decision_us, 2),
        "attempts": list(rec.attempts),
        "queued_ms": 0.0 if rec.queued_at is None else round((now - rec.queued_at) * 1e3, 2),
        "cost": None,
        "server_address": node.address,
        "metadata": dict(req.metadata),
    })
    checked = sum(e.nodes_checked for e in decision.evaluated)
    alternatives = reserved.fallback or checked - 1 - len(rec.tried) > 0
    base = decision.base_ttft_ms
    explained = 0.0 if base is None else max(0.0, decision.predicted_ttft_ms - base)
    typical = None if node.service_ms is None else node.service_ms / 1000.0
    return Step(node, reserved.reservation, info, node.completion_url,
                _attempt_timeout(req, rec, now, settings, alternatives, typical),
                explained_ms=explained)


def _attempt_timeout(req: Request, rec: Record, now: float, settings: FlowSettings,
                     alternatives: bool, typical_s: float | None = None
                     ) -> dict[str, float | None]:
    """Per-attempt transport timeouts, none beyond the overall deadline, as the ``timeout``
    request extension httpx2 reads (``connect``, ``read``, ``write``, ``pool`` seconds).

    A stream's read timeout bounds the wait for its answer to start (``first_token``, else
    ``idle``); once it started, the stream switches to :func:`idle_timeout`. A non-streamed
    answer arrives whole: it gets ``first_token`` when set, else — when routing saw other
    candidates, or the policy's chain has nodes in a later family — the time left shared among
    the attempts left, so a stalled node leaves time to fail over (with no other candidate it
    may use all the time left). The clients hold that bound for the whole answer
    (:func:`zml.client_base.answer_deadline`), not only between two reads. That share is never
    less than twice what the node usually takes to answer (``typical_s``, its service-time
    estimate): a tight deadline must not cut short, and count as the node's failure, an
    answer that is only as slow as usual.
    """
    t = req.timeouts
    deadline = req.deadline
    remaining = None if deadline is None else max(0.001, deadline - now)

    def cap(value: float | None) -> float | None:
        if value is None:
            return remaining
        return value if remaining is None else min(value, remaining)

    if req.stream:
        read = t.first_token if t.first_token is not None else t.idle
    elif t.first_token is not None:
        read = t.first_token
    elif remaining is not None and alternatives:
        left = max(1, settings.max_attempts - len(rec.attempts))
        read = remaining / left
        if typical_s is not None:
            read = max(read, 2.0 * typical_s)
    else:
        read = None
    connect = cap(t.connect)
    return {"connect": connect, "read": cap(read), "write": connect, "pool": connect}


def idle_timeout(req: Request, now: float) -> float | None:
    """A stream's read timeout once its answer has started: ``idle``, within the deadline."""
    idle = req.timeouts.idle
    deadline = req.deadline
    if deadline is None:
        return idle
    remaining = max(0.001, deadline - now)
    return remaining if idle is None else min(idle, remaining)


def _no_route(req: Request, rec: Record, decision: routing.NoRoute, now: float,
              saturated: bool) -> Generator[Operation, Any, Wait | None]:
    """No node now: wait for a rate-limited node, or (``saturated``: freed capacity could
    serve it) in the saturation queue; None: just joined it, route again at once."""
    # A rate-limited node whose Retry-After falls within the deadline: wait and retry it.
    deadline = req.deadline
    if rec.retry_at:
        node_id, at = min(rec.retry_at.items(), key=lambda kv: kv[1])
        if deadline is None or at <= deadline:
            del rec.retry_at[node_id]
            rec.tried.discard(node_id)
            return Wait(until=at)
    if rec.attempts:
        raise _exhausted(rec, decision.context())
    ticket = rec_ticket(req, rec)
    if saturated and ticket is not None:
        if not ticket.queued:
            yield from _enqueue(req, rec, now, decision.context())
            return None  # in line now: look again (a slot may have freed in between)
        until = now + QUEUE_RECHECK_S
        if rec.queue_deadline is not None:
            until = min(until, rec.queue_deadline)
        return Wait(until=until, ticket=ticket)
    raise RoutingError(decision.context())


def _enqueue(req: Request, rec: Record, now: float,
             context: dict[str, Any]) -> Generator[Operation, Any, None]:
    """Join the back of the policy's saturation queue (``context`` for queue_full)."""
    policy = req.policy
    ticket = rec_ticket(req, rec)
    assert policy is not None and ticket is not None
    joined = yield Enqueue(ticket)
    if not joined:
        context["final_error"] = "queue_full"
        context["recommendation"] = (
            f"{QUEUE_LIMIT} requests are already queued for policy {policy.name!r}; "
            "increase fleet capacity"
        )
        raise RoutingError(context)
    if rec.queued_at is not None:
        return  # back in line after a refused lease: the first wait still counts
    yield Notify("zml_request_queued", {"policy": policy.name, "depth": joined})
    rec.queued_at = now
    limit = now + policy.max_queue_ms / 1e3 if policy.max_queue_ms else None
    deadline = req.deadline
    if deadline is not None:
        limit = deadline if limit is None else min(limit, deadline)
    rec.queue_deadline = limit


def _behind_until(req: Request, rec: Record) -> float:
    """A request behind others in its queue sleeps until it is woken or gives up."""
    return math.inf if rec.queue_deadline is None else rec.queue_deadline


def _queue_timeout(req: Request, rec: Record, now: float, behind: bool) -> RoutingError:
    """``max_queue_ms`` passed in the saturation queue (``behind``: still behind others)."""
    ctx = _context(req, rec, "queue_timeout")
    waited = 0.0 if rec.queued_at is None else (now - rec.queued_at) * 1e3
    policy = req.policy
    limit = f"max_queue_ms={policy.max_queue_ms:g}" if policy and policy.max_queue_ms else ""
    ctx["recommendation"] = (
        f"waited {waited:.0f} ms in the saturation queue{', its ' + limit if limit else ''}, "
        f"and {_why_queued(rec, behind)}; increase fleet capacity or raise max_queue_ms"
    )
    return RoutingError(ctx)


def _why_queued(rec: Record, behind: bool) -> str:
    """Why a queued request was still waiting, from its last routing trace."""
    if behind:
        return "requests queued earlier for the same model were still waiting ahead of it"
    found = ", ".join(f"{e['family']} {e['rejected_reason']}" for e in rec.trace
                      if e.get("rejected_reason"))
    return f"no node could take it ({found})" if found else "no node could take it"


def _context(req: Request, rec: Record, final_error: str) -> dict[str, Any]:
    return {
        "policy": req.policy_name,
        "evaluated": list(rec.trace),
        "final_error": final_error,
        "recommendation": "",
    }


def _exhausted(rec: Record, context: dict[str, Any]) -> RoutingError:
    context = dict(context)
    context["final_error"] = "attempts_exhausted"
    kinds = sorted({a.error for a in rec.attempts})
    context["recommendation"] = (
        f"{len(rec.attempts)} attempt(s) failed ({', '.join(kinds)}); check the nodes in "
        "'attempts' or add capacity to the chain"
    )
    context["attempts"] = [a.model_dump() for a in rec.attempts]
    err = RoutingError(context)
    err.__cause__ = rec.last_error
    return err


def _check_deadline(req: Request, rec: Record, now: float, behind: bool = False) -> None:
    deadline = req.deadline
    if deadline is None or now < deadline:
        return
    routing_info = rec.current.routing if rec.current else None
    ticket = rec.ticket
    if ticket is not None and ticket.queued and rec.queued_at is not None:
        waited = (now - rec.queued_at) * 1e3
        raise ZMLTimeoutError(
            f"request deadline of {req.timeouts.total}s expired after {waited:.0f} ms in the "
            f"saturation queue of policy {req.policy_name!r}, and {_why_queued(rec, behind)}; "
            "raise the timeout or increase fleet capacity (max_queue_ms ends the wait sooner, "
            "with RoutingError queue_timeout)",
            routing=routing_info,
        )
    raise ZMLTimeoutError(
        f"request deadline of {req.timeouts.total}s expired after "
        f"{len(rec.attempts)} failed attempt(s)",
        routing=routing_info,
    )


def _deadline_during(req: Request, rec: Record, step: Step) -> ZMLTimeoutError:
    """The error for an attempt cut short by the request's own deadline."""
    failed = len(rec.attempts)
    node = step.node.id
    where = (f"before node {node!r} sent its first token" if req.stream
             else f"while node {node!r} was answering")
    fix = "raise the timeout" if req.stream else \
        "raise the timeout, ask for fewer tokens (max_tokens) or stream the answer"
    return ZMLTimeoutError(
        f"request deadline of {req.timeouts.total}s expired {where}"
        + (f", after {failed} failed attempt(s)" if failed else "") + f"; {fix}",
        routing=step.routing,
    )


def _failed(req: Request, rec: Record, step: Step, exc: NodeError,
            settings: FlowSettings) -> Generator[Operation, Any, None]:
    """``step`` failed before any token reached the caller: release, mark, maybe go on.

    A timeout at the request's own deadline is the caller's budget running out, not the
    node failing: the node is not marked, and the request ends with the deadline's
    ZMLTimeoutError.
    """
    now = yield Now()
    yield Release(step.reservation)
    exc.node_id = exc.node_id or step.node.id
    exc.routing = step.routing
    deadline = req.deadline
    if deadline is not None and isinstance(exc, NodeTimeoutError) \
            and now + _DEADLINE_SLACK_S >= deadline:
        raise _deadline_during(req, rec, step) from exc
    rec.last_error = exc
    attempt = Attempt(
        node_id=step.node.id,
        accelerator=step.node.family,
        error=exc.kind,
        status_code=getattr(exc, "status_code", None),
        message=str(exc)[:300],
    )
    rec.attempts.append(attempt)
    if not exc.retryable or not exc.node_fault:
        if exc.node_fault and not isinstance(exc, NodeStatusError):
            # A protocol violation (a malformed answer, a redirect, a body too deep or too
            # large): not retried, since the node may have done the work, but the node's
            # doing, so it counts against its health like any other failure.
            yield Mark(step.node, ok=False, now=now)
        # The request ends here, but this attempt failed like any other: plugins hear of it
        # (and the attempt count is the same whether the request ends served or failed).
        yield Notify("zml_attempt_failed", {"attempt": attempt, "error": exc})
        raise exc
    if isinstance(exc, RateLimitError):
        if exc.retry_after is not None:
            rec.retry_at[step.node.id] = now + min(exc.retry_after, RETRY_AFTER_MAX_S)
    else:
        yield Mark(step.node, ok=False, now=now)
    yield Notify("zml_attempt_failed", {"attempt": attempt, "error": exc})
    if len(rec.attempts) >= settings.max_attempts:
        _check_deadline(req, rec, now + _DEADLINE_SLACK_S)
        rec.trace = step.routing.evaluated
        raise _exhausted(rec, _context(req, rec, "attempts_exhausted"))


def success_flow(
    req: Request,
    rec: Record,
    step: Step,
    usage: Mapping[str, Any] | None,
    response: ResponseSummary,
    cost_inputs: Mapping[str, Any],
) -> Generator[Operation, Any, RoutingInfo]:
    """``step`` answered in full: release the slot, record latencies, attribute the cost."""
    now = yield Now()
    rec.response = response
    rec.current = step
    yield Release(step.reservation)
    # A whole answer says nothing of its first token: only a stream's TTFT is learned.
    first = step.first_token_at
    ttft = None if first is None or not req.stream else first - step.sent_at
    yield Mark(step.node, ok=True, now=now, ttft_s=ttft, service_s=now - step.sent_at,
               explained_ms=step.explained_ms)
    rec.outcome = "completed"
    info = step.routing
    held_s = now - step.reservation.taken_at
    found = yield Notify(
        "zml_attribute_cost",
        {"routing": info, "usage": usage, "held_s": held_s, **cost_inputs},
    )
    cost: Cost | None = None
    if isinstance(found, Cost):
        cost = found
    elif isinstance(found, Mapping):
        try:
            cost = Cost.model_validate(found)
        except ValueError:
            cost = None
    info.cost = cost
    yield Notify(
        "zml_request_completed",
        {"routing": info, "usage": usage, "held_s": held_s, "cost": cost},
    )
    return info


def broke_flow(req: Request, rec: Record, step: Step,
               exc: NodeError) -> Generator[Operation, Any, NodeError]:
    """``step`` failed after tokens reached the caller: no retry; returns the error to raise."""
    now = yield Now()
    yield Release(step.reservation)
    if exc.node_fault:
        yield Mark(step.node, ok=False, now=now)
    exc.node_id = exc.node_id or step.node.id
    exc.routing = step.routing
    return exc


def end_flow(req: Request, rec: Record,
             error: BaseException | None) -> Generator[Operation, Any, None]:
    """The request ends without a response: free its slot and queue place, notify once.

    Does nothing more after the request already ended (safe to run twice).
    """
    step = rec.current
    if step is not None and not step.reservation.released:
        yield Release(step.reservation)
    if rec.ticket is not None:
        yield Dequeue(rec.ticket)
    if rec.ended:
        return
    if isinstance(error, ZMLError):
        rec.outcome = "failed"
        yield Notify("zml_request_failed", {"error": error})
    else:
        rec.outcome = "cancelled"
        yield Notify("zml_request_cancelled", {})
