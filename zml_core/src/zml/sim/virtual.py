"""The virtual-clock driver: replay through the *production* core, against node models.

A ``--policy`` row of ``zml sim replay`` must show what zml itself would have done, so each
arrival goes through the same :class:`zml.dispatch.Dispatcher`, :class:`zml.fleet.Fleet`
(reservations, health, latency EWMAs, saturation queues), routing engine and attempt flow
(:meth:`zml.dispatch.Call.flow`) as a live request; only the clock and the nodes are not real.
The clock is a number this driver moves from event to event; the nodes are
:class:`zml.sim.model.NodeModel` instances (one per ``[[nodes]]``), so nothing sleeps and
nothing is sent.

How the driver answers the flow's I/O operations (the common ones are carried out by
:class:`zml.dispatch.Effects`, exactly as live, through :meth:`Call.advance`):

* ``Send(step)``: the request is admitted to the step's node model. ``queue_full`` (the
  model's HTTP 503) is sent back into the flow as a :class:`zml.NodeUnavailableError`, so the
  flow marks the node and fails over by its own rules; ``exceeds_kv_cache`` is the node's HTTP
  400, raised at once (``final_error`` ``context_length_exceeded`` in the table). Otherwise
  the flow is resumed when the model emits the request's first token (the answer is a stream:
  the flow returns the step), then ``call.first_token(step)`` is called at that virtual time
  and ``call.succeeded(step, usage, ResponseSummary(...))`` at the model's finish — so the
  fleet's TTFT and service-time EWMAs, health and the cost attribution (the default
  ``zml_attribute_cost`` plugin) are updated as for a live call.
* ``Wait(until, ticket)``: the flow resumes at ``until``; with a ticket the driver arms it
  (:meth:`zml.dispatch.Ticket.arm`), so a slot freed by another request's ending wakes the
  queued request at that virtual instant.
* ``Lease``: virtual fleets have no cross-process ledger; granted.

Events at one instant run in this order: node events (a slot freed at ``t`` is free at
``t``), then flow resumptions (in the order they were scheduled), then the arrival. Every
request ends in exactly one outcome; a request whose flow is still waiting when nothing more
can happen (no event left) is ended with ``final_error`` ``stalled`` — it cannot happen with
the built-in flow, and the table would show it.

Simplifications: requests are built directly as :class:`zml.dispatch.Request` (no JSON body is
encoded; ``prompt_chars`` is ``prompt_tokens x CHARS_PER_TOKEN`` so routing sees the size
hint it would see live; when ``Request`` has a ``prefix_blocks`` field, the trace's block ids
go there); the overall deadline is off (``Timeouts(total=None)``), as a replay
measures latency rather than enforcing it; a request is never cancelled mid-stream.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from zml.config import Registry
from zml.dispatch import Call, Dispatcher, Lease, Request, ResponseSummary, Send, Step, Timeouts
from zml.dispatch.request import frozen_metadata
from zml.errors import NodeUnavailableError, RoutingError, ZMLTimeoutError, status_error
from zml.plugins.manager import PluginManager, register_defaults
from zml.policy import Policy
from zml.sim.model import ModelRequest
from zml.sim.replay import Outcome, ReplayFleet, ReplayRun
from zml.sim.traces import Arrival

__all__ = ["CHARS_PER_TOKEN", "VirtualClock", "final_error_of", "replay_policy"]

CHARS_PER_TOKEN = 4
"""Characters of prompt text per token, for the size hint routing reads (``prompt_chars``)."""

_INF = math.inf
_NO_METADATA = frozen_metadata(None)
_REQUEST_FIELDS = frozenset(f.name for f in dataclasses.fields(Request))
_BLOCKS_FIELD = "prefix_blocks" in _REQUEST_FIELDS
"""Whether requests carry their prompt's prefix-block ids (for ``affinity = "prefix"``
routing): when they do, the trace's block ids are passed as they are."""


class VirtualClock:
    """The dispatcher's clock during a replay: seconds, moved by the driver only."""

    __slots__ = ("now",)

    def __init__(self, now: float = 0.0) -> None:
        self.now: float = now

    def __call__(self) -> float:
        return self.now


def final_error_of(exc: BaseException) -> str:
    """The table's error key for a request that ended with ``exc``."""
    if isinstance(exc, RoutingError):
        return str(exc.routing_context.get("final_error") or "routing_error")
    if isinstance(exc, ZMLTimeoutError):
        return "timeout"
    status = getattr(exc, "status_code", None)
    if status == 400:
        return "context_length_exceeded"
    return type(exc).__name__


class _Live:
    """One request under way in the replay."""

    __slots__ = ("call", "flow", "gen", "key", "out", "request", "step", "streaming")

    def __init__(self, call: Call, out: Outcome, request: ModelRequest) -> None:
        self.call = call
        self.flow = call.flow()
        self.out = out
        self.request = request
        self.key = request.key
        self.step: Step | None = None
        self.gen = 0  # which Wait a resumption belongs to (a wake-up and a timer may both fire)
        self.streaming = False


def replay_policy(
    arrivals: Iterable[Arrival],
    registry: Registry,
    policies: Mapping[str, Policy],
    policy: Policy,
    *,
    name: str,
    default_model: str,
    rate_scale: float = 1.0,
    slo_ms: float | None = None,
    seed: int = 0,
    max_attempts: int = 3,
    plugins: PluginManager | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayRun:
    """Replay ``arrivals`` under ``policy`` through the production core (module docs).

    A row naming a ``policy`` of ``policies`` is routed under that one; a name not in
    ``policies`` ends as ``policy_not_found``. Returns a :class:`ReplayRun` (kind
    ``"policy"``) on a fresh :class:`ReplayFleet` of node models.
    """
    if not rate_scale > 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale!r}")
    clock = VirtualClock()
    if plugins is None:
        plugins = PluginManager()
        register_defaults(plugins)
    d = Dispatcher(registry, policies, api_key=None, timeouts=Timeouts(total=None),
                   max_attempts=max_attempts, plugins=plugins, clock=clock,
                   rng=random.Random(seed))
    models = ReplayFleet(registry)
    nodes = models.nodes
    by_id = {n.id: n.index for n in nodes}
    timeouts = Timeouts(total=None, idle=None)
    inv = 1.0 / rate_scale

    node_at = [_INF] * len(nodes)
    node_heap: list[tuple[float, int]] = []
    resumes: list[tuple[float, int, _Live, int]] = []
    seq = 0
    pending: dict[Any, _Live] = {}
    live: dict[int, _Live] = {}
    outcomes: list[Outcome] = []
    last = 0.0

    def push(i: int) -> None:
        t = nodes[i].model.next_event_time()
        if t != node_at[i]:
            node_at[i] = t
            if t < _INF:
                heapq.heappush(node_heap, (t, i))

    def schedule(t: float, state: _Live) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(resumes, (t, seq, state, state.gen))

    def fail(state: _Live, exc: BaseException) -> None:
        state.call.ended(exc)
        state.out.error = final_error_of(exc)
        live.pop(state.out.arrival.index, None)

    def run(state: _Live, result: object) -> None:
        """Step ``state``'s flow from ``result`` until it waits on the clock or a node."""
        call = state.call
        try:
            op, value = call.advance(state.flow, result)
            while op is not None:
                if isinstance(op, Send):
                    step = op.step
                    i = by_id[step.node.id]
                    admission = nodes[i].model.admit(state.request, clock.now)
                    if admission == "queue_full":
                        result = NodeUnavailableError(
                            f"node {step.node.id!r} answered 503: queue full",
                            status_code=503, node_id=step.node.id)
                    elif admission == "exceeds_kv_cache":
                        result = status_error(
                            400, {"error": {"message": "prompt and output exceed the KV cache"}},
                            node_id=step.node.id)
                    else:
                        state.step = step
                        pending[state.key] = state
                        push(i)
                        return
                elif isinstance(op, Lease):
                    result = True
                else:  # Wait
                    state.gen += 1
                    if op.until < _INF:
                        schedule(max(op.until, clock.now), state)
                    ticket = op.ticket
                    if ticket is not None:
                        ticket.arm(_waker(state, state.gen))
                    return
                op, value = call.advance(state.flow, result)
        except BaseException as exc:  # the flow ended the request (its typed error)
            fail(state, exc)
            return
        _first_token(state, value)

    def _waker(state: _Live, gen: int) -> Callable[[], None]:
        def wake() -> None:  # a slot freed: resume the queued request now (if still waiting)
            if state.gen == gen:
                heapq.heappush(resumes, (clock.now, _next_seq(), state, gen))
        return wake

    def _next_seq() -> int:
        nonlocal seq
        seq += 1
        return seq

    def _first_token(state: _Live, value: tuple[Step, Any]) -> None:
        step = value[0]
        state.step = step
        state.streaming = True
        state.call.first_token(step)
        out = state.out
        out.ttft_s = clock.now - out.start_s
        out.node = step.node.id
        out.family = step.node.family

    def node_events(i: int, t: float) -> None:
        node = nodes[i]
        for event in node.model.advance(t):
            if event.kind == "started":
                continue
            state = pending.get(event.key)
            if state is None:
                continue
            clock.now = event.time
            if not state.streaming:  # the first token (or a one-token answer's finish)
                state.out.cached_tokens = event.cached_tokens
                answer = {"node": node.id}
                run(state, answer)
                if event.kind == "first_token":
                    continue
            del pending[state.key]
            _finish(state)

    def _finish(state: _Live) -> None:
        step = state.step
        assert step is not None
        a = state.out.arrival
        usage = {"prompt_tokens": a.prompt_tokens, "completion_tokens": a.output_tokens,
                 "total_tokens": a.prompt_tokens + a.output_tokens}
        info = state.call.succeeded(step, usage, ResponseSummary(None, a.model, "stop"))
        out = state.out
        out.e2e_s = clock.now - out.start_s
        out.cost_usd = info.cost.amount if info.cost is not None else 0.0
        live.pop(a.index, None)

    def arrive(a: Arrival, now: float) -> None:
        out = Outcome(a, now)
        outcomes.append(out)
        chosen = policy
        if a.policy is not None and a.policy != policy.name:
            named = policies.get(a.policy)
            if named is None:
                out.error = "policy_not_found"
                return
            chosen = named
        extra: dict[str, Any] = {"prefix_blocks": a.blocks} if _BLOCKS_FIELD else {}
        request = Request(
            model=a.model or default_model, policy=chosen, accelerator=None, body=b"",
            stream=True, metadata=_NO_METADATA, timeouts=timeouts, started_at=now,
            prompt_chars=a.prompt_tokens * CHARS_PER_TOKEN, **extra)
        call = Call(d, request)
        call.notify_started()
        state = _Live(call, out, ModelRequest(a.index, a.prompt_tokens, a.output_tokens,
                                              a.blocks))
        live[a.index] = state
        run(state, None)

    it = iter(arrivals)
    nxt = next(it, None)
    count = 0
    try:
        while True:
            t_node = node_heap[0][0] if node_heap else _INF
            t_res = resumes[0][0] if resumes else _INF
            t_arr = nxt.arrival_s * inv if nxt is not None else _INF
            if t_node <= t_res and t_node <= t_arr:
                if t_node == _INF:
                    break
                t, i = heapq.heappop(node_heap)
                if t != node_at[i]:
                    continue
                node_at[i] = _INF
                clock.now = max(clock.now, t)
                node_events(i, t)
                push(i)
                last = max(last, t)
            elif t_res <= t_arr:
                t, _, state, gen = heapq.heappop(resumes)
                if gen != state.gen or state.out.arrival.index not in live:
                    continue
                clock.now = max(clock.now, t)
                state.gen += 1
                if state.call.record.ticket is not None:
                    state.call.record.ticket.disarm()
                run(state, None)
                last = max(last, t)
            else:
                assert nxt is not None
                clock.now = max(clock.now, t_arr)
                arrive(nxt, clock.now)
                last = max(last, clock.now)
                count += 1
                if progress is not None and count % 1000 == 0:
                    progress(count)
                nxt = next(it, None)
        for state in list(live.values()):  # waiting forever: nothing left to wake it
            fail(state, ZMLTimeoutError("the replay ended with the request still waiting"))
            state.out.error = "stalled"
    finally:
        d.close()
    if progress is not None:
        progress(count)
    result = ReplayRun(name, "policy", outcomes, models, last, slo_ms)
    result.extra["fleet"] = d.fleet  # the production fleet's state at the end (for inspection)
    return result
