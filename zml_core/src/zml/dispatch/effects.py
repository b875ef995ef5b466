"""Carrying out the operations every driver performs alike (all but Wait, Lease and Send).

An :class:`Effects` belongs to one dispatcher: its clock, random source, fleet (and so the
fleet's lock), saturation queues and plugin hooks. Routing and reserving happen in one
critical section under the fleet's lock, so two tasks or threads can never both take a node's
last slot. Plugin notifications go through pluggy (``pm.hook.<name>``); each notification
implementation is isolated when it is registered (:class:`zml.plugins.manager.PluginManager`),
so a failing plugin never fails a request.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Generator, Mapping, Sequence, Set as AbstractSet
from typing import TYPE_CHECKING, Any, TypeVar, cast

from .. import routing
from ..fleet import Fleet, NodeState
from ..prefix import blocks_of_body
from ..strategies import route_by_strategy
from .ops import (
    Behind,
    Dequeue,
    Enqueue,
    Mark,
    Notify,
    Now,
    Operation,
    Release,
    Reserve,
    Reserved,
    Saturated,
)
from .queue import SaturationQueues

if TYPE_CHECKING:
    from ..plugins.manager import PluginManager
    from .request import Request
    from .view import CallView

__all__ = ["Effects", "could_wait"]

_T = TypeVar("_T")


class Effects:
    """Performs a flow's common operations against one fleet, clock and plugin manager."""

    def __init__(
        self,
        fleet: Fleet,
        *,
        clock: Callable[[], float] = time.monotonic,
        rng: random.Random | None = None,
        plugins: PluginManager | None = None,
    ) -> None:
        self.fleet = fleet
        self.clock = clock
        self.rng: random.Random = rng or random.Random()
        self.plugins = plugins
        self.queues: SaturationQueues = SaturationQueues(fleet.lock)

    def perform(self, op: Operation, view: CallView) -> Any:
        """Carry out ``op`` for the request ``view`` shows; return what the flow receives."""
        kind = type(op)
        if kind is Now:
            return self.clock()
        if kind is Reserve:
            assert isinstance(op, Reserve)
            return self.reserve(op)
        if kind is Release:
            assert isinstance(op, Release)
            if op.refused:
                self.fleet.lease_refused(op.reservation, op.now)
            else:
                self.fleet.release(op.reservation)
            return None
        if kind is Mark:
            assert isinstance(op, Mark)
            if op.ok:
                self.fleet.record_success(
                    op.node, op.now, op.ttft_s, op.service_s, op.explained_ms
                )
            else:
                self.fleet.record_failure(op.node, op.now)
            return None
        if kind is Notify:
            assert isinstance(op, Notify)
            return self.notify(op.hook, view, op.kwargs)
        if kind is Enqueue:
            assert isinstance(op, Enqueue)
            return self.queues.join(op.ticket)
        if kind is Dequeue:
            assert isinstance(op, Dequeue)
            self.queues.leave(op.ticket)
            return None
        raise TypeError(f"{kind.__name__} is carried out by the driver, not by Effects")

    def reserve(self, op: Reserve) -> Reserved | Behind | Saturated | routing.NoRoute:
        """Route and reserve in one critical section (see :class:`~.ops.Reserve`).

        The request's size (``prompt_chars`` -> tokens) and, under ``affinity = "prefix"``,
        its prefix blocks go to routing; a policy's ``strategy`` routes with that baseline
        strategy of :mod:`zml.strategies` instead. A request with a queue ticket finds no node
        as :class:`~.ops.Saturated` when freed capacity could serve it (:func:`could_wait`),
        else as the ``NoRoute``; it is :class:`~.ops.Behind` while requests that wait for
        capacity are ahead of it in its queue.
        """
        req = op.request
        fleet = self.fleet
        policy = req.policy
        strategy = policy.strategy if policy is not None else None
        tokens = routing.prompt_tokens_from_chars(req.prompt_chars)
        blocks = req.prefix_blocks
        if not blocks and policy is not None and policy.affinity == "prefix":
            blocks = blocks_of_body(req.body)  # outside the lock: it hashes the prompt
        with fleet.lock:
            fleet.refresh(op.now)
            t0 = time.perf_counter()
            decision: routing.Decision | routing.NoRoute
            if strategy is not None:
                decision = route_by_strategy(
                    strategy, req.model, fleet, fleet.strategy_state(strategy), self.rng,
                    pinned_family=req.accelerator, exclude=op.exclude,
                )
            else:
                decision = routing.route(
                    policy,
                    req.model,
                    fleet,
                    now=op.now,
                    rng=self.rng,
                    pinned_family=req.accelerator,
                    exclude=op.exclude,
                    health_threshold=req.health_threshold,
                    prompt_tokens=tokens,
                    prefix_blocks=blocks,
                )
            decision_us = (time.perf_counter() - t0) * 1e6
            ticket = op.ticket
            if ticket is not None:
                if isinstance(decision, routing.NoRoute):
                    if not could_wait(fleet, req, decision, tokens, op.now, op.exclude):
                        return decision  # no freed slot can cure it: it fails, queued or not
                    if not self.queues.ahead(ticket):
                        return Saturated(decision)
                    return Behind(tuple(e.as_dict() for e in decision.evaluated))
                if self.queues.ahead(ticket):
                    return Behind(tuple(e.as_dict() for e in decision.evaluated))
            elif isinstance(decision, routing.NoRoute):
                return decision
            node = cast("NodeState", decision.node)  # this fleet's own node
            # An answer that comes whole shows no first token: its prompt counts as
            # prefilled once its predicted TTFT has passed.
            prefill_by = None if req.stream else op.now + decision.predicted_ttft_ms / 1000.0
            reservation = fleet.reserve(node, op.now, tokens, prefill_by)
            fallback = (not req.stream and policy is not None and req.accelerator is None
                        and _later_node(fleet, req.model, policy.accelerator_chain,
                                        decision.family, op.exclude))
            return Reserved(decision, reservation, decision_us, fallback)

    def notify(self, hook: str, view: CallView, kwargs: Mapping[str, Any]) -> Any:
        """Call plugin hook ``hook`` through pluggy with the request's view, its metadata and
        ``kwargs`` (nothing at all when no plugin implements it, or only idle ones do: see
        :meth:`~zml.plugins.manager.PluginManager.wanted`)."""
        pm = self.plugins
        if pm is None or not pm.wanted(hook):
            return None
        return pm.call(hook, {"call": view, "metadata": view.metadata, **kwargs})

    def run(self, flow: Generator[Operation, Any, _T], view: CallView) -> _T:
        """Run a flow made only of common operations (an ending) to completion."""
        try:
            op = next(flow)
            while True:
                op = flow.send(self.perform(op, view))
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]


def could_wait(fleet: Fleet, req: Request, decision: routing.NoRoute, tokens: int,
               now: float, exclude: AbstractSet[str]) -> bool:
    """Whether freed capacity could let routing take a request that found no node: some node
    it may use (not tried for it, circuit not open, health at the threshold or above) would be
    within the latency limit idle (its base TTFT, or the family's prior, plus the prompt's own
    prefill, as :mod:`zml.routing` predicts), so that only the work on it (its slots taken, the
    prefill and requests ahead) stands in the way. Read under the fleet's lock, only when
    routing found no node."""
    policy = req.policy
    limit = math.inf
    threshold = req.health_threshold
    if policy is not None and policy.latency_target_ms is not None:
        limit = policy.latency_target_ms
        if policy.cost_priority == "cost":
            limit *= routing.COST_LATENCY_MARGIN
    for evaluation in decision.evaluated:
        family = evaluation.family
        prior, tps = fleet.family_prior(family)
        own_ms = tokens * 1000.0 / tps if tps else 0.0
        for node in fleet.nodes_for(req.model, family):
            if node.id in exclude or node.health < threshold or (
                    not node.circuit_allows(now) and not node.trial_in_flight):
                continue
            base = node.ttft_ms if node.ttft_ms is not None else prior
            if base + own_ms <= limit:
                return True
    return False


def _later_node(fleet: Fleet, model: str, chain: Sequence[str], family: str,
                exclude: AbstractSet[str]) -> bool:
    """Whether a family of ``chain`` after ``family`` has a node of ``model`` not in
    ``exclude`` (False when ``family`` is the chain's last): somewhere a failed attempt could
    go. It stops at the first such node: at most ``len(exclude) + 1`` looked at per family."""
    if family not in chain:
        return False
    for later in chain[chain.index(family) + 1:]:
        for node in fleet.nodes_for(model, later):
            if node.id not in exclude:
                return True
    return False
