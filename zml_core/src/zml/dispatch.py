"""One logical request, from its arguments to exactly one response or one error.

The attempt loop is written once, here, without I/O: :meth:`Call.attempt_flow` is a generator
that yields what to do next (a :class:`Wait`: the policy queues on saturation, or a node asked
to retry later; a :class:`Lease` from a cross-process ledger; a :class:`Send` of the request to
the node whose slot it reserved) and receives what happened. :func:`drive` runs it with
blocking I/O and :func:`adrive` with ``await``; the sync ``Client``, the ``AsyncClient`` and
both stream openers each hand them a send function, and nothing else.

Failover rules (the contract):

* A retryable failure (connection refused/reset, timeout before the first byte, 429, 500, 502,
  503, 504) *before the first token reached the caller* marks the node (health, circuit) and
  routes again, excluding the nodes already tried, up to ``max_attempts`` dispatches within the
  request's deadline. Every failed attempt is listed in ``routing.attempts``.
* 429 honours ``Retry-After``: the node is skipped until then; if it is the only candidate left
  and the time falls within the deadline, the call waits and tries it again.
* 400, 401, 403, 404 and 422 are never retried: the typed error is raised at once.
* After the first token, nothing is retried: a broken stream raises IncompleteStreamError.
* When attempts run out, :class:`RoutingError` with ``final_error`` ``"attempts_exhausted"``
  (context key ``attempts``), chained from the last node error.

``final_error`` values: ``no_viable_node`` (routing found no node), ``queue_timeout`` (waited
``max_queue_ms`` in the saturation queue), ``queue_full`` (the saturation queue is at
``QUEUE_LIMIT``), ``attempts_exhausted`` (every attempt failed).
"""

from __future__ import annotations

import random
import time
import uuid
from collections import deque
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import httpx2

from . import routing
from .config import Registry, suggest
from .errors import (
    InvalidRequestError,
    NodeError,
    RateLimitError,
    RoutingError,
    ZMLError,
    ZMLTimeoutError,
)
from .fleet import STATE_LOCK, Fleet, NodeState, Reservation, notify_capacity
from .ledger import SlotLedger
from .policy import Policy
from .transport import StreamDecoder, auth_headers, completion_url, encode_body
from .types import Attempt, Cost, RoutingInfo

__all__ = [
    "FINAL_ERRORS",
    "MAX_ATTEMPTS",
    "OPENAI_PARAMS",
    "QUEUE_LIMIT",
    "Call",
    "Dispatcher",
    "Step",
    "Timeouts",
    "Wait",
    "validate_messages",
]

MAX_ATTEMPTS = 3
QUEUE_LIMIT = 1024
QUEUE_RECHECK_S = 0.25
FINAL_ERRORS = ("no_viable_node", "queue_timeout", "queue_full", "attempts_exhausted")

ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})

OPENAI_PARAMS = frozenset(
    {
        "temperature", "top_p", "max_tokens", "max_completion_tokens", "stop", "n", "seed",
        "tools", "tool_choice", "parallel_tool_calls", "response_format", "presence_penalty",
        "frequency_penalty", "logit_bias", "logprobs", "top_logprobs", "user", "stream_options",
        "reasoning_effort", "modalities", "prediction", "service_tier", "store", "extra_body",
    }
)
"""Parameters passed through to the node; anything else is a typo and is refused."""


class Observer:
    """What plugins see of a call: the hook points of dispatch (all no-ops here).

    The plugin manager supplies the real one (telemetry, cost attribution). Every call gets
    ``started`` once, ``routed`` for each dispatch decision, ``attempt_failed`` for each failed
    attempt, then exactly one of ``completed`` (which returns the request's cost, if known),
    ``errored`` or ``cancelled``. Implementations must not raise.
    """

    def started(self, call: Call) -> None:
        """The call was validated and is about to be routed."""

    def routed(self, call: Call, routing: RoutingInfo) -> None:
        """A node was chosen and a slot reserved (once per attempt)."""

    def attempt_failed(self, call: Call, attempt: Attempt, error: NodeError) -> None:
        """An attempt failed before the first token; another may follow."""

    def completed(
        self, call: Call, routing: RoutingInfo, usage: Mapping[str, Any] | None, held_s: float
    ) -> Cost | None:
        """The call succeeded; ``held_s`` is how long it held its slot. Returns its cost."""
        return None

    def errored(self, call: Call, error: ZMLError) -> None:
        """The call ended with a zml error (routing, node, timeout...)."""

    def cancelled(self, call: Call) -> None:
        """The caller went away (task cancelled, stream closed early, an error in its code)."""


NULL_OBSERVER = Observer()


@dataclass(frozen=True)
class Timeouts:
    """Timeouts in seconds (None: no limit).

    Attributes:
        total: the overall deadline of a request: queueing, every attempt, and the whole stream.
        connect: establishing a connection to a node.
        first_token: from sending to the first byte of a streamed answer (per attempt); a
            non-streamed answer arrives whole, within ``total``.
        idle: between two chunks of a stream.
    """

    total: float | None = 600.0
    connect: float = 5.0
    first_token: float | None = None
    idle: float | None = 60.0

    @classmethod
    def of(cls, value: float | Timeouts | None) -> Timeouts:
        """Accept a number (the overall deadline), a Timeouts, or None (no overall deadline)."""
        if isinstance(value, Timeouts):
            return value
        if value is None:
            return cls(total=None)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise InvalidRequestError(
                f"timeout must be a positive number of seconds or a zml.Timeouts, got {value!r}",
                param="timeout",
            )
        return cls(total=float(value))


@dataclass(frozen=True)
class ResponseSummary:
    """What telemetry needs of a finished answer: the node's id and model, the finish reason."""

    id: str | None
    model: str | None
    finish_reason: str | None


@dataclass
class Step:
    """Send the request to ``node``: a slot is reserved for it."""

    node: NodeState
    reservation: Reservation
    routing: RoutingInfo
    url: str
    timeout: httpx2.Timeout
    sent_at: float = 0.0
    first_token_at: float | None = None


@dataclass(frozen=True)
class Wait:
    """Wait until ``until`` (monotonic seconds), or until capacity frees if ``for_capacity``."""

    until: float
    for_capacity: bool


@dataclass(frozen=True)
class Lease:
    """Ask ``ledger`` for a lease on ``step``'s node; answer with the bool it returns."""

    ledger: SlotLedger
    step: Step
    lease_id: str


@dataclass(frozen=True)
class Send:
    """Send the request on ``step``; answer with the result, or the NodeError it raised."""

    step: Step


Operation = Wait | Lease | Send
"""What :meth:`Call.attempt_flow` asks its driver to do."""

_T = TypeVar("_T")


def drive(call: Call, wait: Callable[[Wait], None], send: Callable[[Step], _T]) -> tuple[Step, _T]:
    """Run ``call``'s attempt flow with blocking I/O: the sync client's whole attempt loop.

    ``send`` performs one attempt and returns its result (raising a NodeError on failure).
    Returns the step that answered and its result; on any exception the call is ended.
    """
    flow = call.attempt_flow()
    try:
        op = next(flow)
        while True:
            outcome: object
            if isinstance(op, Wait):
                wait(op)
                outcome = None
            elif isinstance(op, Lease):
                outcome = op.ledger.acquire(op.step.node, op.lease_id)
            else:
                try:
                    outcome = send(op.step)
                except NodeError as exc:
                    outcome = exc
            op = flow.send(outcome)
    except StopIteration as done:
        return cast("tuple[Step, _T]", done.value)
    except BaseException as exc:
        call.ended(exc)
        raise


async def adrive(
    call: Call, wait: Callable[[Wait], Awaitable[None]], send: Callable[[Step], Awaitable[_T]]
) -> tuple[Step, _T]:
    """:func:`drive` for the async client: the same flow, awaiting each operation."""
    flow = call.attempt_flow()
    try:
        op = next(flow)
        while True:
            outcome: object
            if isinstance(op, Wait):
                await wait(op)
                outcome = None
            elif isinstance(op, Lease):
                outcome = await op.ledger.aacquire(op.step.node, op.lease_id)
            else:
                try:
                    outcome = await send(op.step)
                except NodeError as exc:
                    outcome = exc
            op = flow.send(outcome)
    except StopIteration as done:
        return cast("tuple[Step, _T]", done.value)
    except BaseException as exc:
        call.ended(exc)
        raise


def validate_messages(messages: object) -> list[dict[str, Any]]:
    """Check ``messages`` is a non-empty list of role/content mappings; return it as dicts."""
    if isinstance(messages, str | bytes) or not isinstance(messages, Sequence):
        raise InvalidRequestError(
            "messages must be a list of {'role': ..., 'content': ...} mappings, got "
            f"{type(messages).__name__}; e.g. messages=[{{'role': 'user', 'content': 'Hello'}}]",
            param="messages",
        )
    if not messages:
        raise InvalidRequestError("messages must not be empty", param="messages")
    out: list[dict[str, Any]] = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise InvalidRequestError(
                f"messages[{i}] must be a mapping with 'role' and 'content', got "
                f"{type(msg).__name__}",
                param=f"messages[{i}]",
            )
        role = msg.get("role")
        if role not in ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role = {role!r} is not a chat role; use one of "
                + ", ".join(sorted(ROLES)),
                param=f"messages[{i}].role",
            )
        content = msg.get("content")
        if content is None:
            if not (role == "assistant" and msg.get("tool_calls")):
                raise InvalidRequestError(
                    f"messages[{i}] ({role}) has no 'content'; only an assistant message "
                    "with tool_calls may omit it",
                    param=f"messages[{i}].content",
                )
        elif not isinstance(content, str | list):
            raise InvalidRequestError(
                f"messages[{i}].content must be a string or a list of content parts, got "
                f"{type(content).__name__}",
                param=f"messages[{i}].content",
            )
        out.append(dict(msg))
    return out


def _check_params(params: Mapping[str, Any]) -> None:
    for key in params:
        if key not in OPENAI_PARAMS:
            hint = suggest(key, OPENAI_PARAMS)
            raise InvalidRequestError(
                f"unknown parameter {key!r}"
                + (f"; did you mean {hint!r}?" if hint else "")
                + "; pass other node-specific fields in extra_body={...}",
                param=key,
            )


class Dispatcher:
    """What both clients share: the registry, the fleet state, named policies and settings."""

    def __init__(
        self,
        registry: Registry,
        policies: Mapping[str, Policy],
        *,
        api_key: str | None,
        timeouts: Timeouts,
        max_attempts: int = MAX_ATTEMPTS,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.registry = registry
        self.policies = policies
        self.fleet = Fleet(registry)
        self.timeouts = timeouts
        self.max_attempts = max_attempts
        self.clock = clock
        self.rng = rng or random.Random()
        self._headers = auth_headers(api_key)
        self._queues: dict[str, deque[Call]] = {}
        self.observer: Observer = NULL_OBSERVER

    def start(
        self,
        *,
        model: str,
        messages: object,
        policy: Policy | None,
        accelerator: str | None,
        params: Mapping[str, Any],
        stream: bool,
        metadata: Mapping[str, Any] | None,
        timeouts: Timeouts,
    ) -> Call:
        """Validate one request and return its :class:`Call` (nothing is sent yet)."""
        if not isinstance(model, str) or not model.strip():
            raise InvalidRequestError(
                f"model must be a non-empty model name, got {model!r}", param="model"
            )
        msgs = validate_messages(messages)
        _check_params(params)
        if accelerator is not None and accelerator not in self.registry.families:
            hint = suggest(str(accelerator), self.registry.families)
            raise InvalidRequestError(
                f"accelerator={accelerator!r} is not a registered family (registered: "
                + ", ".join(self.registry.families)
                + ")"
                + (f"; did you mean {hint!r}?" if hint else ""),
                param="accelerator",
            )
        if metadata is not None and not isinstance(metadata, Mapping):
            raise InvalidRequestError(
                f"metadata must be a dict, got {type(metadata).__name__}", param="metadata"
            )
        body: dict[str, Any] = {"model": model, "messages": msgs}
        extra = params.get("extra_body")
        for key, value in params.items():
            if key != "extra_body":
                body[key] = value
        if extra:
            if not isinstance(extra, Mapping):
                raise InvalidRequestError("extra_body must be a dict", param="extra_body")
            body.update(extra)
        if stream:
            body["stream"] = True
            options = dict(body.get("stream_options") or {})
            options.setdefault("include_usage", True)
            body["stream_options"] = options
        call = Call(self, model, policy, accelerator, encode_body(body), stream,
                    dict(metadata or {}), timeouts)
        self.observer.started(call)
        return call

    def dry_run(
        self, policy: Policy | None, model: str, accelerator: str | None = None
    ) -> routing.Decision | routing.NoRoute:
        """The decision routing would make now, without reserving anything."""
        with STATE_LOCK:
            now = self.clock()
            self.fleet.refresh(now)
            return routing.route(
                policy, model, self.fleet, now=now, rng=self.rng, pinned_family=accelerator
            )


class Call:
    """One logical request: routes, reserves, records outcomes; never sends anything itself."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        model: str,
        policy: Policy | None,
        accelerator: str | None,
        body: bytes,
        stream: bool,
        metadata: dict[str, Any],
        timeouts: Timeouts,
    ) -> None:
        self.d = dispatcher
        self.model = model
        self.policy = policy
        self.accelerator = accelerator
        self.body = body
        self.headers = dispatcher._headers
        self.stream = stream
        self.metadata = metadata
        self.timeouts = timeouts
        self.started_at = dispatcher.clock()
        self.deadline = None if timeouts.total is None else self.started_at + timeouts.total
        self.attempts: list[Attempt] = []
        self.tried: set[str] = set()
        self.retry_at: dict[str, float] = {}
        self.last_error: NodeError | None = None
        self.queued_at: float | None = None
        self.queue_deadline: float | None = None
        self.last_trace: list[dict[str, Any]] = []
        self.current: Step | None = None
        self.finished = False
        self.response: ResponseSummary | None = None
        """The answer's id, model and finish reason, once it completed."""
        self.state: dict[str, Any] = {}
        """Scratch space for plugins (a telemetry span, say), per call."""

    @property
    def policy_name(self) -> str | None:
        """The policy's name, or None."""
        return self.policy.name if self.policy is not None else None

    # --- deciding --------------------------------------------------------------------------

    def attempt_flow(self) -> Generator[Operation, object, tuple[Step, object]]:
        """The attempt loop, without I/O: yields what to do, receives what happened.

        Route and reserve; wait when told to; take a lease when a ledger is installed (a
        refusal routes again); send; on a NodeError before the first token, mark the node
        and route again (``failed`` raises when that is over). Returns the step that answered
        and what its send returned. :func:`drive` and :func:`adrive` run it.
        """
        while True:
            step = self.next()
            if isinstance(step, Wait):
                yield step
                continue
            ledger = self.ledger
            if ledger is not None:
                lease_id = self.lease_id(step)
                granted = yield Lease(ledger, step, lease_id)
                if not self.leased(step, lease_id, bool(granted)):
                    continue
            self.sent(step)
            outcome = yield Send(step)
            if isinstance(outcome, NodeError):
                self.failed(step, outcome)
                continue
            return step, outcome

    def next(self) -> Step | Wait:
        """Route and reserve a slot (a Step), or say how long to wait; raise when it is over."""
        d = self.d
        with STATE_LOCK:
            now = d.clock()
            self._check_deadline(now)
            queue = self._queue()
            if queue and self in queue and self._behind(queue):
                return self._wait_in_queue(now)
            d.fleet.refresh(now)
            t0 = time.perf_counter()
            decision = routing.route(
                self.policy,
                self.model,
                d.fleet,
                now=now,
                rng=d.rng,
                pinned_family=self.accelerator,
                exclude=self.tried,
                health_threshold=self.policy.health_threshold if self.policy else 0.5,
            )
            decision_us = (time.perf_counter() - t0) * 1e6
            if isinstance(decision, routing.Decision):
                if queue and self.queued_at is None and not self.attempts and self._behind(queue):
                    # A slot is free, but requests queued earlier for this model come first.
                    self.last_trace = [e.as_dict() for e in decision.evaluated]
                    return self._enqueue(now, queue, self._context_from_trace("queue_full"))
                self._leave_queue()
                return self._reserve(decision, now, decision_us)
            self.last_trace = [e.as_dict() for e in decision.evaluated]
            return self._no_route(decision, now, queue)

    def _reserve(self, decision: routing.Decision, now: float, decision_us: float) -> Step:
        node = decision.node
        assert isinstance(node, NodeState)
        load = node.load
        reservation = self.d.fleet.reserve(node, now)
        info = RoutingInfo.model_construct(
            node_id=node.id,
            accelerator=node.family,
            policy=self.policy_name,
            queue_depth=max(0, load - node.max_concurrency),
            node_load=load,
            predicted_ttft_ms=decision.predicted_ttft_ms,
            evaluated=[e.as_dict() for e in decision.evaluated],
            decision_us=round(decision_us, 2),
            attempts=list(self.attempts),
            queued_ms=0.0 if self.queued_at is None else round((now - self.queued_at) * 1e3, 2),
            cost=None,
            server_address=node.url.split("://", 1)[-1],
            metadata=self.metadata,
        )
        step = Step(node, reservation, info, completion_url(node.url), self._attempt_timeout(now))
        self.current = step
        self.tried.add(node.id)
        self.d.observer.routed(self, info)
        return step

    def _attempt_timeout(self, now: float) -> httpx2.Timeout:
        """Per-attempt timeouts, none beyond the overall deadline.

        A non-streamed answer arrives whole, so its read timeout is the time left. A stream's
        read timeout here bounds the wait for the answer to start (``first_token``, else
        ``idle``); once it started, the stream switches to :meth:`idle_timeout`.
        """
        t = self.timeouts
        remaining = None if self.deadline is None else max(0.001, self.deadline - now)

        def cap(value: float | None) -> float | None:
            if value is None:
                return remaining
            return value if remaining is None else min(value, remaining)

        read: float | None = None
        if self.stream:
            read = t.first_token if t.first_token is not None else t.idle
        return httpx2.Timeout(
            connect=cap(t.connect), read=cap(read), write=cap(t.connect), pool=cap(t.connect)
        )

    def idle_timeout(self) -> float | None:
        """A stream's read timeout once its answer has started: ``idle``, within the deadline."""
        idle = self.timeouts.idle
        if self.deadline is None:
            return idle
        remaining = max(0.001, self.deadline - self.d.clock())
        return remaining if idle is None else min(idle, remaining)

    def _no_route(self, decision: routing.NoRoute, now: float, queue: deque[Call] | None) -> Wait:
        # A rate-limited node whose Retry-After falls within the deadline: wait and retry it.
        if self.retry_at:
            node_id, at = min(self.retry_at.items(), key=lambda kv: kv[1])
            if self.deadline is None or at <= self.deadline:
                del self.retry_at[node_id]
                self.tried.discard(node_id)
                return Wait(until=at, for_capacity=False)
        if self.attempts:
            raise self._exhausted(decision.context())
        policy = self.policy
        if policy is not None and policy.queue_on_saturation and queue is not None:
            if self.queued_at is None:
                return self._enqueue(now, queue, decision.context())
            return self._wait_in_queue(now)
        raise RoutingError(decision.context())

    def _enqueue(self, now: float, queue: deque[Call], context: dict[str, Any]) -> Wait:
        """Join the back of the policy's saturation queue (``context`` for queue_full)."""
        policy = self.policy
        assert policy is not None
        if len(queue) >= QUEUE_LIMIT:
            context["final_error"] = "queue_full"
            context["recommendation"] = (
                f"{QUEUE_LIMIT} requests are already queued for policy {policy.name!r}; "
                "increase fleet capacity"
            )
            raise RoutingError(context)
        self.queued_at = now
        wait_s = policy.max_queue_ms / 1e3 if policy.max_queue_ms else None
        limit = None if wait_s is None else now + wait_s
        if self.deadline is not None:
            limit = self.deadline if limit is None else min(limit, self.deadline)
        self.queue_deadline = limit
        queue.append(self)
        return self._wait_in_queue(now)

    def _behind(self, queue: deque[Call]) -> bool:
        """Whether a request for the same model queued before this one (FIFO per model; a
        request not in the queue is behind every queued one)."""
        for other in queue:
            if other is self:
                return False
            if other.model == self.model:
                return True
        return False

    def _wait_in_queue(self, now: float) -> Wait:
        if self.queue_deadline is not None and now >= self.queue_deadline:
            self._leave_queue()
            ctx = self._context_from_trace("queue_timeout")
            waited = 0.0 if self.queued_at is None else (now - self.queued_at) * 1e3
            ctx["recommendation"] = (
                f"no capacity freed within {waited:.0f} ms of queueing; increase fleet capacity "
                "or raise max_queue_ms"
            )
            raise RoutingError(ctx)
        until = now + QUEUE_RECHECK_S
        if self.queue_deadline is not None:
            until = min(until, self.queue_deadline)
        return Wait(until=until, for_capacity=True)

    def _queue(self) -> deque[Call] | None:
        if self.policy is None or not self.policy.queue_on_saturation:
            return None
        return self.d._queues.setdefault(self.policy.name, deque())

    def _leave_queue(self) -> None:
        if self.queued_at is None or self.policy is None:
            return
        queue = self.d._queues.get(self.policy.name)
        if queue is not None and self in queue:
            queue.remove(self)
            if queue:  # the next request for this model may route now
                notify_capacity()

    def _context_from_trace(self, final_error: str) -> dict[str, Any]:
        return {
            "policy": self.policy_name,
            "evaluated": list(self.last_trace),
            "final_error": final_error,
            "recommendation": "",
        }

    def _exhausted(self, context: dict[str, Any]) -> RoutingError:
        context = dict(context)
        context["final_error"] = "attempts_exhausted"
        kinds = sorted({a.error for a in self.attempts})
        context["recommendation"] = (
            f"{len(self.attempts)} attempt(s) failed ({', '.join(kinds)}); check the nodes in "
            "'attempts' or add capacity to the chain"
        )
        context["attempts"] = [a.model_dump() for a in self.attempts]
        err = RoutingError(context)
        err.__cause__ = self.last_error
        return err

    def _check_deadline(self, now: float) -> None:
        if self.deadline is not None and now >= self.deadline:
            self._leave_queue()
            raise ZMLTimeoutError(
                f"request deadline of {self.timeouts.total}s expired after "
                f"{len(self.attempts)} failed attempt(s)",
                routing=self.current.routing if self.current else None,
            )

    def deadline_error(self, decoder: StreamDecoder) -> ZMLTimeoutError:
        """The error for a stream whose overall deadline expired mid-stream."""
        return ZMLTimeoutError(
            f"request deadline of {self.timeouts.total}s expired mid-stream after "
            f"{decoder.chunks} chunks; the answer is incomplete",
            routing=self.current.routing if self.current else None,
            text=decoder.text,
        )

    # --- outcomes --------------------------------------------------------------------------

    @property
    def ledger(self) -> SlotLedger | None:
        """The cross-process slot ledger, if a plugin installed one (see :mod:`zml.ledger`)."""
        return self.d.fleet.ledger

    def lease_id(self, step: Step) -> str:
        """An id for ``step``'s lease, unique across processes and machines."""
        return uuid.uuid4().hex

    def leased(self, step: Step, lease_id: str, granted: bool) -> bool:
        """The ledger answered for ``step``: keep going (True) or route again (False)."""
        if granted:
            step.reservation.lease_id = lease_id
            return True
        self.d.fleet.lease_refused(step.reservation, self.d.clock())
        self.tried.discard(step.node.id)
        self.current = None
        return False

    def sent(self, step: Step) -> None:
        """The request is about to be sent on ``step``."""
        step.sent_at = self.d.clock()

    def first_token(self, step: Step) -> None:
        """The first chunk of ``step``'s answer arrived (failover is over from here)."""
        step.first_token_at = self.d.clock()

    def failed(self, step: Step, exc: NodeError) -> float:
        """``step`` failed before any token reached the caller.

        Releases the slot and marks the node. Returns nothing to wait before routing again
        (0.0); raises ``exc`` (non-retryable) or RoutingError (attempts exhausted).
        """
        d = self.d
        now = d.clock()
        d.fleet.release(step.reservation)
        exc.node_id = exc.node_id or step.node.id
        exc.routing = step.routing
        self.last_error = exc
        if not exc.retryable:
            raise exc
        if isinstance(exc, RateLimitError):
            if exc.retry_after is not None:
                self.retry_at[step.node.id] = now + exc.retry_after
            # rate limiting is load, not ill health: the node's score is left alone
        else:
            d.fleet.record_failure(step.node, now)
        attempt = Attempt(
            node_id=step.node.id,
            accelerator=step.node.family,
            error=exc.kind,
            status_code=getattr(exc, "status_code", None),
            message=str(exc)[:300],
        )
        self.attempts.append(attempt)
        d.observer.attempt_failed(self, attempt, exc)
        if len(self.attempts) >= d.max_attempts:
            self.last_trace = step.routing.evaluated
            raise self._exhausted(self._context_from_trace("attempts_exhausted"))
        return 0.0

    def broke(self, step: Step, exc: NodeError) -> NodeError:
        """``step`` failed after tokens reached the caller: no retry; the error to raise."""
        d = self.d
        d.fleet.release(step.reservation)
        d.fleet.record_failure(step.node, d.clock())
        exc.node_id = exc.node_id or step.node.id
        exc.routing = step.routing
        return exc

    @property
    def ttft_s(self) -> float | None:
        """Seconds from sending to the first token of the attempt that answered, once known."""
        step = self.current
        if step is None or step.first_token_at is None:
            return None
        return step.first_token_at - step.sent_at

    def succeeded(
        self, step: Step, usage: Mapping[str, Any] | None, response: ResponseSummary
    ) -> RoutingInfo:
        """``step`` answered in full: release the slot, record latencies, attribute the cost."""
        d = self.d
        now = d.clock()
        self.response = response
        d.fleet.release(step.reservation)
        ttft = None if step.first_token_at is None else step.first_token_at - step.sent_at
        d.fleet.record_success(step.node, now, ttft, now - step.sent_at)
        self.finished = True
        routing_info = step.routing
        routing_info.cost = d.observer.completed(
            self, routing_info, usage, now - step.reservation.taken_at
        )
        return routing_info

    def ended(self, error: BaseException | None) -> None:
        """The call ends without a response: free its slot and queue place, tell the observer.

        Safe to call more than once and after ``succeeded`` (then it does nothing more).
        """
        if self.current is not None:
            self.d.fleet.release(self.current.reservation)
        with STATE_LOCK:
            self._leave_queue()
        if self.finished:
            return
        self.finished = True
        if isinstance(error, ZMLError):
            self.d.observer.errored(self, error)
        else:
            self.d.observer.cancelled(self)
