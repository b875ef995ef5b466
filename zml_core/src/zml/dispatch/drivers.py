"""Drivers: carry out an attempt flow's operations, blocking (:func:`drive`) or with ``await``
(:func:`adrive`). A virtual-clock driver (replay) runs the same flows against modelled nodes.

A driver steps the flow through :class:`~.effects.Effects` for every operation but the three
that are I/O — :class:`~.ops.Wait`, :class:`~.ops.Lease` and :class:`~.ops.Send` — which it
performs itself. When anything raises (the flow's own errors, the caller's cancellation),
the driver ends the request with :func:`~.flow.end_flow`, so the slot and the queue place are
freed and plugins hear of it exactly once.

:class:`Call` is the drivers' handle on one request: its frozen :class:`~.request.Request`,
its :class:`~.record.Record`, and the endings a stream needs after the flow has returned.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Awaitable, Callable, Generator, Iterator
from typing import TYPE_CHECKING, Any, TypeVar, cast

from ..errors import (
    ClientConfigError,
    NodeError,
    ZMLError,
    ZMLTimeoutError,
    closed_client,
    credentials,
    safe_detail,
    scrub,
)
from . import flow as flows
from .ops import Lease, Now, Operation, Send, Wait
from .record import Record, ResponseSummary, Step
from .view import CallView

if TYPE_CHECKING:
    from ..sse import StreamDecoder
    from ..types import RoutingInfo
    from .dispatcher import Dispatcher
    from .request import Request, Timeouts

__all__ = ["Call", "CallStopped", "adrive", "drive"]

_T = TypeVar("_T")
_IO = (Wait, Lease, Send)  # what drivers carry out themselves
_TOKEN = frozenset("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


_FRAMING = frozenset({
    "connection", "content-encoding", "content-length", "content-type", "expect", "host",
    "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding", "upgrade",
})
"""Headers that say how the request's bytes are framed and carried: the HTTP client sets them
from the body it sends; a plugin's would contradict it (a Content-Length that is not the body's
fails the request in the HTTP stack)."""


def _header_ok(name: object, value: object) -> bool:
    """Whether a plugin's header can be sent as it is: a token name (RFC 9110) that is not a
    framing header, and a value of printable ASCII (HTTP stacks encode values as ASCII; a line
    break would split the header)."""
    return (isinstance(name, str) and isinstance(value, str) and bool(name)
            and _TOKEN.issuperset(name) and name.lower() not in _FRAMING
            and value.isascii() and value.isprintable())


class CallStopped(Exception):
    """The caller stopped the call while it was being dispatched (an async stream closed by
    another task while it opened). Internal: the stream's reader ends quietly, and the failure
    the stop caused is not the node's."""


class Call:
    """One request under way: what was asked, what happened, and its flow's endings."""

    __slots__ = ("d", "opening", "record", "request", "stopped", "view")

    def __init__(self, dispatcher: Dispatcher, request: Request) -> None:
        self.d: Dispatcher = dispatcher
        self.request: Request = request
        self.record: Record = Record()
        self.view: CallView = CallView(request, self.record, dispatcher.clock, dispatcher.fleet.ledger)
        self.stopped: bool = False
        """Set by :meth:`stop`: nothing more is tried (:class:`CallStopped`)."""
        self.opening: Any = None
        """The attempt being opened now (a stream's ``StreamAttempt``), for :meth:`stop`."""

    def stop(self) -> None:
        """Stop the call from another task: the attempt being opened has its connection shut
        down (the node drops the request), a wait in the saturation queue ends, and the driver
        then raises :class:`CallStopped` instead of trying anything else."""
        from ..watchdog import shutdown_socket

        self.stopped = True
        op = self.opening
        if op is not None:
            watch = op.watch
            shutdown_socket(op.response if op.response is not None
                            else watch.response if watch is not None else None)
        ticket = self.record.ticket
        if ticket is not None:
            ticket.wake()

    # --- what senders need -------------------------------------------------------------------

    @property
    def body(self) -> bytes:
        """The encoded request body."""
        return self.request.body

    @property
    def headers(self) -> dict[str, str]:
        """Headers sent with every attempt (authorization) to nodes without a key of their own."""
        return self.d.headers

    def headers_for(self, step: Step) -> tuple[dict[str, str], bool]:
        """The headers for ``step``'s node: its own key (``api_key_env``) or the client's,
        plus what plugins add through ``zml_request_headers`` (a trace context); and whether
        they are the client's own dict, sent again on other requests (False: made for this
        request)."""
        base = self.d.node_headers.get(step.node.id, self.d.headers)
        pm = self.d.effects.plugins
        if pm is None or not pm.wanted("zml_request_headers"):
            return base, True
        added: dict[str, str] = {}
        pm.call("zml_request_headers", {"call": self.view, "routing": step.routing,
                                        "headers": added, "metadata": self.request.metadata})
        if not added:
            return base, True
        merged = {k: v for k, v in added.items() if _header_ok(k, v)}
        if len(merged) < len(added):
            self._refuse_headers(pm, {k: v for k, v in added.items() if k not in merged})
        lowered = {k.lower() for k in base}
        for name in [k for k in merged if k.lower() in lowered]:
            del merged[name]
        merged.update(base)
        return merged, False

    def _refuse_headers(self, pm: Any, bad: dict[Any, Any]) -> None:
        # Logged like a plugin's exception (once, then at DEBUG); the request goes on without
        # them. Names only: a value may hold a secret.
        names = ", ".join(repr(k)[:60] for k in bad)
        pm.report("(a zml_request_headers implementation)", "zml_request_headers", ValueError(
            f"header(s) {names} added by a plugin are not sent: a header name must be an HTTP "
            "token other than those the HTTP client sets from the body (Content-Length, "
            "Content-Type, Host, Transfer-Encoding, Connection...), and its value printable ASCII "
            "without line breaks (encode other text, e.g. urllib.parse.quote)"))

    @property
    def stream(self) -> bool:
        """Whether the answer is streamed."""
        return self.request.stream

    @property
    def timeouts(self) -> Timeouts:
        """The request's timeouts."""
        return self.request.timeouts

    @property
    def deadline(self) -> float | None:
        """The overall deadline on the dispatcher's clock."""
        return self.request.deadline

    def flow(self) -> Generator[Operation, Any, tuple[Step, Any]]:
        """A new attempt flow for this request."""
        return flows.attempt_flow(self.request, self.record, self.d.settings())

    def notify_started(self) -> None:
        """Tell plugins the request is about to be routed."""
        self.d.effects.notify("zml_request_started", self.view, {})

    def first_token(self, step: Step) -> None:
        """The first chunk of ``step``'s answer arrived (failover is over from here)."""
        step.first_token_at = self.d.clock()
        if self.request.stream:  # a whole answer's slot (and prefill count) is released next
            self.d.fleet.first_token(step.reservation)

    def idle_timeout(self) -> float | None:
        """A stream's read timeout once its answer started: ``idle``, within the deadline."""
        return flows.idle_timeout(self.request, self.d.clock())

    def deadline_error(self, decoder: StreamDecoder) -> ZMLTimeoutError:
        """The error for a stream whose overall deadline expired mid-stream."""
        current = self.record.current
        return ZMLTimeoutError(
            f"request deadline of {self.request.timeouts.total}s expired mid-stream after "
            f"{decoder.chunks} chunks; the answer is incomplete",
            routing=current.routing if current else None,
            text=decoder.text,
        )

    @property
    def ttft_s(self) -> float | None:
        """Seconds from sending to the first token of the attempt that answered."""
        return self.record.ttft_s

    # --- endings ------------------------------------------------------------------------------

    def succeeded(self, step: Step, usage: Any, response: ResponseSummary) -> RoutingInfo:
        """``step`` answered in full: release, record latencies, attribute the cost."""
        inputs = {
            "accelerator": self.d.registry.families.get(step.node.family),
            "node": step.node.config,
        }
        ending = flows.success_flow(self.request, self.record, step, usage, response, inputs)
        return self.d.effects.run(ending, self.view)

    def credentials(self, step: Step) -> tuple[str, ...]:
        """The credentials sent on ``step`` (its node's key or the client's, and any a plugin
        or the HTTP client's default headers added): never shown."""
        sent = step.sent_headers
        return credentials(sent if sent is not None
                           else self.d.node_headers.get(step.node.id, self.d.headers))

    def answered(self, step: Step, answer: object) -> None:
        """``step``'s node answered: take the attempt's credentials out of the answer's
        metadata (a node may echo its key into a completion's ``id`` or ``model``) before the
        caller, the plugins or a gateway's callers see it. A whole answer (its decoded JSON)
        is scrubbed here; a stream's chunks as they are decoded, with ``step.scrub_answer``."""
        scrub_answer = step.scrub_answer = self.d.answer_scrubber(self.credentials(step))
        if scrub_answer is not None and isinstance(answer, dict):
            scrub_answer(answer)

    def closed(self) -> ClientConfigError | None:
        """The error of this call if its client was closed while it was in flight, else None:
        a failure from then on is the closing's doing, not the node's."""
        kind = self.d.closed_by
        return None if kind is None else closed_client(kind, in_flight=True)

    def broke(self, step: Step, exc: NodeError) -> NodeError:
        """``step`` failed after tokens reached the caller: no retry; the error to raise."""
        scrub(exc, self.credentials(step))
        return self.d.effects.run(flows.broke_flow(self.request, self.record, step, exc),
                                  self.view)

    def ended(self, error: BaseException | None) -> None:
        """The request ends without a response (safe to call again, and after success)."""
        self.d.effects.run(flows.end_flow(self.request, self.record, error), self.view)

    # --- stepping the flow (used by the drivers) ----------------------------------------------

    def advance(self, flow: Generator[Operation, Any, Any], result: object
                ) -> tuple[Wait | Lease | Send | None, Any]:
        """Send ``result`` into ``flow`` and carry out common operations until it asks for
        I/O (returned) or returns (``(None, value)``)."""
        effects = self.d.effects
        view = self.view
        clock = effects.clock
        try:
            op = flow.send(result)
            while not isinstance(op, _IO):
                # Now, the most frequent operation, is answered here (Effects.perform's first
                # case, without the call).
                op = flow.send(clock() if type(op) is Now else effects.perform(op, view))
        except StopIteration as done:
            return None, done.value
        return op, None

    def lease_id(self) -> str:
        """A lease id unique across processes and machines."""
        return uuid.uuid4().hex


def _granted(op: Lease, lease_id: str, granted: bool) -> bool:
    if granted:
        op.step.reservation.lease_id = lease_id
    return granted


def _ledger_failed(call: Call, exc: Exception) -> bool:
    """A ledger whose ``acquire`` raised: reported (once, as a plugin's exception), and the
    request keeps the local slot it reserved (as a ledger that lost its store answers), without
    a lease to give back (one the store did take expires with its TTL)."""
    pm = call.d.effects.plugins
    if pm is not None:
        pm.report(type(call.d.fleet.ledger).__name__, "SlotLedger.acquire", exc)
    return True


def drive(call: Call, wait: Callable[[Wait], None], send: Callable[[Step], _T]) -> tuple[Step, _T]:
    """Run ``call``'s attempt flow with blocking I/O: the sync client's whole attempt loop.

    ``send`` performs one attempt and returns its result (raising a NodeError on failure).
    Returns the step that answered and its result; on any exception the call is ended.
    """
    flow = call.flow()
    with _ending(call):
        op, value = call.advance(flow, None)
        while op is not None:
            _check_open(call)  # a cheap attribute read while the client is open
            if isinstance(op, Wait):
                wait(op)
                value = None
            elif isinstance(op, Lease):
                lid = call.lease_id()
                try:
                    value = _granted(op, lid, _ledger(call).acquire(op.step.node, lid))
                except Exception as exc:
                    value = _ledger_failed(call, exc)
            else:
                value = _outcome(call, send, op.step)
            op, value = call.advance(flow, value)
        return cast("tuple[Step, _T]", value)


async def adrive(
    call: Call, wait: Callable[[Wait], Awaitable[None]], send: Callable[[Step], Awaitable[_T]]
) -> tuple[Step, _T]:
    """:func:`drive` for the async client: the same flow, awaiting each I/O operation."""
    flow = call.flow()
    with _ending(call):
        op, value = call.advance(flow, None)
        while op is not None:
            _check_open(call)
            if isinstance(op, Send):
                value = await _aoutcome(call, send, op.step)
            elif isinstance(op, Lease):
                lid = call.lease_id()
                try:
                    value = _granted(op, lid, await _ledger(call).aacquire(op.step.node, lid))
                except Exception as exc:
                    value = _ledger_failed(call, exc)
            else:
                await wait(op)
                value = None
            op, value = call.advance(flow, value)
        return cast("tuple[Step, _T]", value)


@contextlib.contextmanager
def _ending(call: Call) -> Iterator[None]:
    """End ``call`` (slot, queue place, one notification) when its driver raises anything:
    the flow's own errors, a cancellation, an exception in the caller's code."""
    try:
        yield
    except BaseException as exc:
        call.ended(exc)
        raise


def _check_open(call: Call) -> None:
    """Raise the closed-client error if the call's client was closed, or CallStopped if the
    call was stopped (before a wait, a lease, a send, and after a failed send): from then on
    nothing more is tried, and a failure is the closing's doing, so it neither fails over nor
    marks the node."""
    if call.d.closed_by is not None:  # the open case costs one attribute read
        raise cast("ClientConfigError", call.closed()) from None
    if call.stopped:
        raise CallStopped from None


def _outcome(call: Call, send: Callable[[Step], _T], step: Step) -> _T | NodeError:
    try:
        answer = send(step)
    except NodeError as exc:
        _check_open(call)
        scrub(exc, call.credentials(step))  # a node may quote the key it was sent
        return exc
    except (ZMLError, CallStopped):
        _check_open(call)
        raise
    except Exception as exc:  # not the node's answer: the HTTP stack could not send
        _check_open(call)
        raise _not_sent(call, step, exc) from exc
    call.answered(step, answer)  # ... in its answer too
    return answer


async def _aoutcome(call: Call, send: Callable[[Step], Awaitable[_T]], step: Step
                    ) -> _T | NodeError:
    try:
        answer = await send(step)
    except NodeError as exc:
        _check_open(call)
        scrub(exc, call.credentials(step))  # a node may quote the key it was sent
        return exc
    except (ZMLError, CallStopped):
        _check_open(call)
        raise
    except Exception as exc:  # not the node's answer: the HTTP stack could not send
        _check_open(call)
        raise _not_sent(call, step, exc) from exc
    call.answered(step, answer)  # ... in its answer too
    return answer


def _not_sent(call: Call, step: Step, exc: Exception) -> ClientConfigError:
    """The error for a send that failed on this side with an exception that is no transport
    error (httpx2's RuntimeError for a send on a closed ``http_client``, a custom transport's
    own): a ClientConfigError, so the request fails (not "cancelled"), once, and no node is
    blamed; its message is scrubbed of the attempt's credentials."""
    err = ClientConfigError(
        f"the HTTP client could not send the request to node {step.node.id!r}: "
        f"{type(exc).__name__}: {safe_detail(str(exc), 300)}; an http_client you passed must "
        "stay open while zml uses it (and its transport must send): pass an open one, or "
        "build a new client", param="http_client")
    scrub(err, call.credentials(step))
    return err


def _ledger(call: Call) -> Any:
    ledger = call.d.fleet.ledger
    assert ledger is not None, "a Lease operation needs the fleet's ledger"
    return ledger
