"""Trace replay in virtual time: a fleet of node models, arrivals from a trace, a router.

This engine runs the baseline-strategy rows (``--strategy``) and any custom router; the
``--policy`` rows run through the production core instead, with the virtual-clock driver of
:mod:`zml.sim.virtual` (which reuses this module's :class:`ReplayFleet` and :class:`Outcome`).

Replay answers "how would this routing have done on that traffic, on this fleet?" in seconds
of wall time for an hour of traffic: no sockets and no sleeping. The engine owns the clock and
the node models (:class:`zml.sim.model.NodeModel`, one per ``[[nodes]]`` of a ``zml.toml``);
the router only decides. The seam is :class:`Router`::

    router(arrival, model, now, fleet, exclude) -> node id | Reject(final_error)

``fleet`` is a :class:`ReplayFleet`: it satisfies ``zml.routing.FleetView`` (so
``zml.routing.route`` runs against it unchanged) and its nodes satisfy both
``zml.routing.NodeView`` and ``zml.strategies.Candidate``. A router that keeps state of its own
(reservations in a production fleet, say) gets every outcome through ``on_event``.

The loop (heapq, one entry per node holding its next event; stale entries skipped):

1. take the earliest of the next arrival and the earliest node event (node events first on a
   tie, so a slot freed at ``t`` is free for an arrival at ``t``);
2. a node event: ``node.advance(t)``; a first token and a finish are recorded on the request,
   and when a request finishes the node's observations are updated as the production fleet
   does when a call ends (EWMA of time to first token and of service time, weight
   ``zml.fleet.EWMA_ALPHA``; the last ``LATENCY_WINDOW`` TTFTs for latency_based);
3. an arrival (time x 1/rate_scale): the router is asked; the chosen node's model admits it, or
   answers ``queue_full`` (HTTP 503: the router is asked again, excluding the nodes tried, up
   to ``max_attempts`` in all, then ``attempts_exhausted``) or ``exceeds_kv_cache`` (HTTP 400,
   final: ``context_length_exceeded``). A ``Reject`` from the router is final.

Every request ends with exactly one outcome: completed (TTFT, end-to-end time, node, cost) or
an error (``final_error``). :mod:`zml.sim.report` turns runs into the table and the JSON.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from zml.config import AcceleratorConfig, NodeConfig, Registry, suggest
from zml.errors import InvalidRequestError
from zml.fleet import EWMA_ALPHA
from zml.plugins.default.cost import default_cost
from zml.sim.from_config import node_profile
from zml.sim.model import ModelRequest, NodeModel
from zml.sim.traces import Arrival
from zml.strategies import LATENCY_WINDOW, STRATEGIES, StrategyState
from zml.validation import brief_repr

__all__ = [
    "Outcome",
    "Reject",
    "ReplayFleet",
    "ReplayNode",
    "ReplayRun",
    "Router",
    "StrategyRouter",
    "replay",
]

_INF = math.inf


@dataclass(frozen=True, slots=True)
class Reject:
    """A router's answer when no node can take the request: the request's ``final_error``."""

    final_error: str


class ReplayNode:
    """One modelled node, as routing and the strategies read it."""

    __slots__ = ("config", "family", "health", "id", "in_flight", "index", "max_concurrency",
                 "max_queue", "model", "recent", "service_ms", "ttft_ms")

    def __init__(self, index: int, config: NodeConfig, model: NodeModel) -> None:
        self.index: int = index
        self.config: NodeConfig = config
        self.id: str = config.id
        self.family: str = config.family
        self.max_concurrency: int = config.max_concurrency
        self.max_queue: int = config.max_queue
        self.model: NodeModel = model
        self.health: float = 1.0
        self.in_flight: int = 0
        self.ttft_ms: float | None = None
        self.service_ms: float | None = None
        self.recent: deque[float] = deque(maxlen=LATENCY_WINDOW)

    @property
    def load(self) -> int:
        """Requests on the node (running and waiting)."""
        return self.model.load

    @property
    def latency_ms(self) -> float | None:
        """Mean of the last ``LATENCY_WINDOW`` observed TTFTs (None before the first)."""
        recent = self.recent
        return sum(recent) / len(recent) if recent else None

    def circuit_allows(self, now: float) -> bool:
        """Modelled nodes never fail, so their breakers stay closed."""
        return True

    def observe(self, ttft_ms: float, service_ms: float) -> None:
        """A call ended: fold its TTFT and service time into the node's estimates."""
        self.ttft_ms = ttft_ms if self.ttft_ms is None else (
            self.ttft_ms + EWMA_ALPHA * (ttft_ms - self.ttft_ms))
        self.service_ms = service_ms if self.service_ms is None else (
            self.service_ms + EWMA_ALPHA * (service_ms - self.service_ms))
        self.recent.append(ttft_ms)


class ReplayFleet:
    """A fresh set of node models for a registry (satisfies ``zml.routing.FleetView``)."""

    def __init__(self, registry: Registry, *, time_scale: float = 1.0) -> None:
        self.registry = registry
        self.nodes: list[ReplayNode] = []
        for i, config in enumerate(registry.nodes):
            profile = node_profile(config, registry.families.get(config.family))
            model = NodeModel(profile, config.max_concurrency, queue_size=config.sim.queue_size,
                              time_scale=time_scale)
            self.nodes.append(ReplayNode(i, config, model))
        self.by_id: dict[str, ReplayNode] = {n.id: n for n in self.nodes}
        self._families = tuple(dict.fromkeys([*registry.families, *(n.family for n in self.nodes)]))
        self._index: dict[tuple[str, str], list[ReplayNode]] = {}
        self._serving: dict[str, list[ReplayNode]] = {}
        for node in self.nodes:
            for m in node.config.models:
                self._index.setdefault((m, node.family), []).append(node)
                self._serving.setdefault(m, []).append(node)

    def families(self) -> Sequence[str]:
        """Every family, in registry order."""
        return self._families

    def family_cost(self, family: str) -> float | None:
        """The family's cost_per_hour."""
        acc = self.registry.families.get(family)
        return None if acc is None else acc.cost_per_hour

    def nodes_for(self, model: str, family: str) -> Sequence[ReplayNode]:
        """The family's nodes serving the model."""
        return self._index.get((model, family), ())

    def serving(self, model: str) -> Sequence[ReplayNode]:
        """Every node serving the model, in registry order."""
        return self._serving.get(model, ())

    def models(self) -> list[str]:
        """Every model some node serves."""
        return list(self._serving)


class Router(Protocol):
    """Decides where one request goes; the engine owns the clock and the nodes."""

    def __call__(self, arrival: Arrival, model: str, now: float, fleet: ReplayFleet,
                 exclude: frozenset[str]) -> str | Reject: ...


class StrategyRouter:
    """A baseline strategy of ``zml.strategies`` as a replay router (candidates: every node
    serving the model, except those already tried for this request; ``attempts_exhausted``
    once every one was tried)."""

    def __init__(self, name: str, seed: int = 0) -> None:
        if not isinstance(name, str) or name not in STRATEGIES:
            hint = suggest(name, STRATEGIES) if isinstance(name, str) else None
            raise InvalidRequestError(
                f"unknown strategy {brief_repr(name)}"
                + (f"; did you mean {hint!r}?" if hint else "")
                + f" (known: {', '.join(sorted(STRATEGIES))})",
                param="strategy",
            )
        self.name = name
        self._choose = STRATEGIES[name]
        self._state = StrategyState()
        self._rng = random.Random(seed)

    def __call__(self, arrival: Arrival, model: str, now: float, fleet: ReplayFleet,
                 exclude: frozenset[str]) -> str | Reject:
        candidates: Sequence[ReplayNode] = fleet.serving(model)
        if not candidates:
            return Reject("no_viable_node")
        if exclude:
            candidates = [n for n in candidates if n.id not in exclude]
            if not candidates:  # every node was tried and answered 503
                return Reject("attempts_exhausted")
        return candidates[self._choose(candidates, self._state, self._rng)].id


class Outcome:
    """What happened to one request of the trace."""

    __slots__ = ("arrival", "cached_tokens", "cost_usd", "e2e_s", "error", "family", "node",
                 "start_s", "ttft_s")

    def __init__(self, arrival: Arrival, start_s: float) -> None:
        self.arrival: Arrival = arrival
        self.start_s: float = start_s
        """Arrival time after rate scaling (virtual seconds)."""
        self.node: str | None = None
        self.family: str | None = None
        self.ttft_s: float | None = None
        self.e2e_s: float | None = None
        self.cached_tokens: int = 0
        self.cost_usd: float = 0.0
        self.error: str | None = None

    @property
    def completed(self) -> bool:
        return self.e2e_s is not None


@dataclass
class ReplayRun:
    """One row of a replay: a router over the whole trace on a fresh fleet."""

    name: str
    kind: str
    """``"policy"`` or ``"strategy"``."""
    outcomes: list[Outcome]
    fleet: ReplayFleet
    virtual_s: float
    slo_ms: float | None = None
    extra: dict[str, object] = field(default_factory=dict)


EventHook = Callable[[str, Arrival, "str | None", float], None]
"""``on_event(kind, arrival, node_id, time)``: kind is admitted | first_token | finished |
rejected (node_id None when the router rejected)."""


def replay(
    arrivals: Iterable[Arrival],
    fleet: ReplayFleet,
    router: Router,
    *,
    name: str,
    kind: str,
    default_model: str,
    rate_scale: float = 1.0,
    max_attempts: int = 3,
    slo_ms: float | None = None,
    on_event: EventHook | None = None,
    progress: Callable[[int], None] | None = None,
) -> ReplayRun:
    """Replay ``arrivals`` through ``router`` on ``fleet`` in virtual time (module docs).

    ``progress(n)`` is called every 1,000 arrivals with how many have arrived so far.
    """
    if not rate_scale > 0:
        raise ValueError(f"rate_scale must be > 0, got {rate_scale!r}")
    if max_attempts < 1:
        raise ValueError(f"max_attempts must be >= 1, got {max_attempts!r}")
    nodes = fleet.nodes
    families = fleet.registry.families
    heap: list[tuple[float, int]] = []
    scheduled = [_INF] * len(nodes)
    pending: dict[int, Outcome] = {}
    outcomes: list[Outcome] = []
    inv = 1.0 / rate_scale
    last = 0.0

    def push(i: int) -> None:
        t = nodes[i].model.next_event_time()
        if t != scheduled[i]:
            scheduled[i] = t
            if t < _INF:
                heapq.heappush(heap, (t, i))

    def node_events(i: int, t: float) -> None:
        node = nodes[i]
        for event in node.model.advance(t):
            if event.kind == "started":
                continue
            out = pending.get(event.key)  # type: ignore[call-overload]
            if out is None:
                continue
            if event.kind == "first_token":
                out.ttft_s = event.time - out.start_s
                out.cached_tokens = event.cached_tokens
                if on_event is not None:
                    on_event("first_token", out.arrival, node.id, event.time)
                continue
            del pending[out.arrival.index]
            e2e = event.time - out.start_s
            out.e2e_s = e2e
            if out.ttft_s is None:
                out.ttft_s = e2e
            node.in_flight -= 1
            node.observe(out.ttft_s * 1000.0, e2e * 1000.0)
            out.cost_usd = _cost(families.get(node.family), node.config, out.arrival, e2e)
            if on_event is not None:
                on_event("finished", out.arrival, node.id, event.time)

    def dispatch(a: Arrival, now: float) -> None:
        out = Outcome(a, now)
        outcomes.append(out)
        model = a.model or default_model
        exclude: frozenset[str] = frozenset()
        request = ModelRequest(a.index, a.prompt_tokens, a.output_tokens, a.blocks)
        for _ in range(max_attempts):
            choice = router(a, model, now, fleet, exclude)
            if isinstance(choice, Reject):
                out.error = choice.final_error
                break
            node = fleet.by_id[choice]
            admission = node.model.admit(request, now)
            if admission == "queue_full":
                exclude = exclude | {node.id}
                continue
            if admission == "exceeds_kv_cache":
                out.error = "context_length_exceeded"
                break
            out.node = node.id
            out.family = node.family
            node.in_flight += 1
            pending[a.index] = out
            if on_event is not None:
                on_event("admitted", a, node.id, now)
            push(node.index)
            return
        else:
            out.error = "attempts_exhausted"
        if on_event is not None:
            on_event("rejected", a, None, now)

    it = iter(arrivals)
    nxt = next(it, None)
    count = 0
    while True:
        if heap and (nxt is None or heap[0][0] <= nxt.arrival_s * inv):
            t, i = heapq.heappop(heap)
            if t != scheduled[i]:
                continue
            scheduled[i] = _INF
            node_events(i, t)
            push(i)
            last = t
        elif nxt is not None:
            now = nxt.arrival_s * inv
            dispatch(nxt, now)
            last = max(last, now)
            count += 1
            if progress is not None and count % 1000 == 0:
                progress(count)
            nxt = next(it, None)
        else:
            break
    if progress is not None:
        progress(count)
    return ReplayRun(name, kind, outcomes, fleet, last, slo_ms)


def _cost(acc: AcceleratorConfig | None, node: NodeConfig, a: Arrival, held_s: float) -> float:
    usage = {"prompt_tokens": a.prompt_tokens, "completion_tokens": a.output_tokens}
    cost = default_cost(acc, node, usage, held_s)
    return 0.0 if cost is None else cost.amount
